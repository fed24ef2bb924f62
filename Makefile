# Two commands after cloning: `make run` (the main job) and `make test` (the test suite).
# Each installs what it needs: Debian packages (bubblewrap, git, skopeo, ...) when missing, and a Python
# 3.12 venv in .venv with sandpool and its test dependencies.

SHELL := /bin/bash
VENV  := .venv
# Python 3.12 for the dev venv: python3.12 on PATH, else pyenv's newest 3.12.
PY312 := $(shell for p in python3.12 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1); do \
           $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { command -v $$p || echo $$p; } && break; done)
RUN_ARGS ?=
PYTEST_ARGS ?=

NG_VENV := .venvs/nemo-gym
SANDPOOL_SRC := pyproject.toml $(shell find sandpool -type f -not -name '*.pyc' -not -path '*/.venv/*' 2>/dev/null)

.PHONY: run test sysdeps dockerdeps venv nemo-gym-venv cluster-build bench clean

sysdeps:
	@command -v bwrap >/dev/null && command -v git >/dev/null && command -v skopeo >/dev/null \
	  && command -v umoci >/dev/null && command -v mmdebstrap >/dev/null && command -v mkfs.ext4 >/dev/null \
	  && command -v docker-registry >/dev/null && command -v runc >/dev/null && test -x /usr/lib/cni/ptp || { \
	  echo "installing bubblewrap, git, skopeo, umoci, mmdebstrap, e2fsprogs, docker-registry, runc, CNI plugins (Debian packages)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap git skopeo umoci \
	    mmdebstrap e2fsprogs docker-registry runc containernetworking-plugins >/dev/null; }

## Debian's Docker (dockerd 20.10, containerd 1.6, runc 1.1): the baseline the tests and the
## benchmark compare with. They start a daemon of their own and stop it; `make run` needs none.
## A policy-rc.d that denies starts keeps the package's own service from starting on install.
dockerdeps:
	@command -v dockerd >/dev/null && command -v containerd >/dev/null || { \
	  echo "installing docker.io (Debian package; its service is not started)"; \
	  own=; [ -e /usr/sbin/policy-rc.d ] || { own=1; printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; \
	    chmod 755 /usr/sbin/policy-rc.d; }; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    docker.io >/dev/null; rc=$$?; [ -z "$$own" ] || rm -f /usr/sbin/policy-rc.d; exit $$rc; }

$(VENV)/.installed: pyproject.toml
	@test -n "$(PY312)" || { echo "Python 3.12 not found: install it (e.g. pyenv install 3.12) and retry"; exit 1; }
	$(PY312) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

## NeMo Gym from this clone (examples/nemo_gym/README.md): .venvs/nemo-gym with sandpool[nemo-gym]
## and uv, and sandpool's wheel in dist/ for the per-server venv NeMo Gym builds with uv.
nemo-gym-venv: $(NG_VENV)/.installed dist/.sandpool-wheel

$(NG_VENV)/.installed: pyproject.toml
	@test -n "$(PY312)" || { echo "Python 3.12 not found: install it (e.g. pyenv install 3.12) and retry"; exit 1; }
	$(PY312) -m venv $(NG_VENV)
	$(NG_VENV)/bin/pip install -q --upgrade pip
	$(NG_VENV)/bin/pip install -q -e '.[nemo-gym]' uv
	touch $@

dist/.sandpool-wheel: $(SANDPOOL_SRC) $(NG_VENV)/.installed
	rm -f dist/sandpool-*.whl
	$(NG_VENV)/bin/pip wheel -q --no-deps -w dist .
	touch $@

## The main job: the default task pack x 4 rollouts, oracle and noop policies, local sandboxes.
run: sysdeps venv
	$(VENV)/bin/sandpool run $(RUN_ARGS)

## The test suite: unit, real bubblewrap sandboxes, the local Kubernetes cluster, integrations.
## The integration sessions' venvs (pip downloads) build in the background meanwhile: on a cold
## machine they overlap the cluster's compile and the main suite instead of following them.
test: sysdeps dockerdeps venv
	@mkdir -p reports; $(VENV)/bin/nox -s venvs > reports/venvs.log 2>&1 & vp=$$!; \
	  $(MAKE) --no-print-directory cluster-build && $(VENV)/bin/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	  wait $$vp; vrc=$$?; [ $$vrc = 0 ] || { tail -40 reports/venvs.log; \
	    echo "building the integration venvs failed: see reports/venvs.log"; }; \
	  [ $$rc = 0 ] && [ $$vrc = 0 ]
	$(VENV)/bin/nox -s nemo_gym-0.4 nemo_gym-0.7
	$(VENV)/bin/nox -s openhands openhands_app
	$(VENV)/bin/nox -s swebench_harness

cluster-build: venv
	$(VENV)/bin/python hack/cluster/cluster.py build
	$(VENV)/bin/python hack/cluster/nodebuild.py

bench: sysdeps dockerdeps venv
	$(VENV)/bin/sandpool bench

clean:
	rm -rf $(VENV) .venvs .nox reports
