"""The python_function loaders copied into each registered version: `policy` serves a policy version, `reward` a
reward-model version. Each imports nothing of this repository, and keeps its earlier name inside a version."""
