# The rlhf-pipeline image: this repository installed (not editable) with its `ray` extra, for the nodes of a
# Ray cluster and for Prefect's Docker and Kubernetes work pools (docs/image.md). `make image` builds
# rlhf-pipeline:<version> (CPU); `make image DEVICE=cuda` builds rlhf-pipeline:<version>-cuda. Only plain
# Dockerfile instructions, so that podman, buildah and docker (with or without BuildKit) build it alike.

# python:3.11-slim-bookworm: the Python the project is measured on, on Debian 12, without a compiler (every
# dependency comes as a wheel). The CUDA variant names an nvidia/cuda base here instead (the Makefile's DEVICE=cuda).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# Python 3.11 with venv and ensurepip: python:3.11-slim has it; a base without it (nvidia/cuda's Ubuntu 22.04,
# a bare Debian 12) gets it from the distribution, and keeps no package lists
RUN if ! python3.11 -m ensurepip --version >/dev/null 2>&1; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3.11 python3.11-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# a virtual environment of its own: the same layout on every base, and pip never touches the system's Python
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1

# more pip options for every install, empty by default: a mirror (--index-url), wheels on a mounted disk
# (--find-links), a certificate bundle (--cert). Build arguments stay in the image's history: never a secret here
ARG EXTRA_PIP_ARGS=""
# pip pinned: the bases bring pip 22 to 24; one resolver everywhere
ARG PIP_VERSION=26.3
RUN python3.11 -m venv /opt/venv \
    && pip install --no-cache-dir ${EXTRA_PIP_ARGS} "pip==${PIP_VERSION}"

# torch first and explicitly, pinned as the Makefile pins it; pyproject.toml's range then keeps this build.
# On PyPI the Linux x86_64 torch wheel is the CUDA build (its CUDA 13 libraries come as pip packages, GBs);
# the CPU build is on download.pytorch.org/whl/cpu. The CUDA variant sets https://pypi.org/simple here
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir ${EXTRA_PIP_ARGS} --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# cpu or cuda: the build stops when torch is the other build (an index that served the wrong wheel)
ARG DEVICE=cpu
RUN python -c "import sys, torch; cuda = torch.version.cuda is not None; \
sys.exit(0 if cuda == ('${DEVICE}' == 'cuda') else f'DEVICE=${DEVICE} but torch {torch.__version__} is the other build')"

# what the package is built from, and configs/ for runs to start from (e.g. /opt/rlhf-pipeline/configs/demo.yaml)
WORKDIR /opt/rlhf-pipeline
COPY pyproject.toml README.md ./
COPY rlhf_core ./rlhf_core
COPY tasks ./tasks
COPY flows ./flows
COPY configs ./configs

# not editable: the code lives in the environment, and this copy of it can go stale or be mounted over
# without changing what runs. Compiled to bytecode here (pip's default): the user below cannot write
# __pycache__ into /opt/venv, so every process would compile the imports again. pip check: no broken requirement
RUN pip install --no-cache-dir ${EXTRA_PIP_ARGS} ".[ray]" \
    && pip check \
    && rm -rf build rlhf_pipeline.egg-info

# the version the labels and the tag name is the version installed, or the build stops
ARG VERSION=0.1.0
RUN python -c "import sys; from importlib.metadata import version; v = version('rlhf-pipeline'); \
sys.exit(0 if v == '${VERSION}' else f'VERSION=${VERSION} but the project installed is {v}')"

# a user without privileges (a number, so that Kubernetes' runAsNonRoot can check it) and the directory runs
# write to: outputs/, ./mlflow.db and ./mlruns of a config's relative paths land here; mount a volume on it
RUN useradd --uid 1000 --user-group --create-home --shell /bin/bash rlhf \
    && mkdir /runs \
    && chown 1000:1000 /runs
USER 1000:1000
WORKDIR /runs
# Nothing forces HF_HUB_OFFLINE: a real model or data set downloads from the hub into ~/.cache/huggingface.
# Credentials (MLFLOW_TRACKING_TOKEN, HF_TOKEN, a judge's key) come from the environment at run time
# No git in the image (the code is the installed package, not a checkout): GitPython, which MLflow imports,
# would print a page about it in every process
ENV GIT_PYTHON_REFRESH=quiet

# last, so that a new commit changes no layer above; BASE_IMAGE again, as a stage sees no ARG from above FROM
ARG BASE_IMAGE
ARG VCS_REF=""
LABEL org.opencontainers.image.title="rlhf-pipeline" \
      org.opencontainers.image.description="RLHF as Prefect flows, tracked in MLflow, with Ray Train (docs/image.md)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      rlhf-pipeline.device="${DEVICE}"

CMD ["rlhf", "--help"]
