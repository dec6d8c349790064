"""Promotion's steps (flows/promote.py): what judges (`evaluator`: resolved and checked before any generation), the
candidate against its opponent prompt by prompt (`contest`), a person's approval (`approval`) and what is recorded
(`record`: the report, the per-prompt table, the tags and the alias)."""
