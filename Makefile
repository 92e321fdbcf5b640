# slurmckpt: top-level targets. Everything runs as root (it installs packages and starts a Slurm test cluster).
#   make setup [NODES=3]   packages, CRIU, venv, SPANK plugin, config, running cluster (scripts/setup.sh)
#   make demo              setup, then scripts/demo.sh
#   make test              setup with 3 nodes (one slurmd per network namespace), then the linter, the
#                          shim's C unit tests (make -C spank test, then shim-matrix), the unit and integration
#                          tests (single-node ones run on node1..3, multi-node ones need 3), and the
#                          docker-slurm test (tests/docker: the container cluster built, a job moved between
#                          its nodes)
#   make shim-matrix       the shim built and its C unit tests run against Debian trixie's (24.11) and sid's
#                          (newest) Slurm headers, downloaded to /var/cache/slurmckpt (scripts/shim-matrix.sh)
#   make install           on a cluster node: the venv in /opt/slurmckpt/venv with the package, the plugins and the
#                          namespace init in /usr/local, the config template where none exists, directories, man
#                          pages and cli_filter.lua (setup.sh's install steps; no test cluster, no packages)
#   make deb               build/slurmckpt_<version>_<arch>.deb with dpkg-deb (scripts/build-deb.sh)
#   make man               build/man/slurmckpt.1 and slurmckpt.yaml.5, generated from the code
#   make lint              pyflakes over src/ and tests/ (Debian's pyflakes3, installed by setup)
#   make docker-slurm      no root needed with Docker: the container cluster of docker-slurm/ built and started,
#                          the demo run in it (a job restored on the other node); make docker-slurm-down stops
#                          it (docker-slurm/cluster.sh, docs/docker-slurm.md)
#   make status | stop     cluster status / stop every daemon of the test cluster
#   make clean             remove build artefacts from the tree (the cluster and installed files stay)
NODES ?= 1
PYTHON := /opt/slurmckpt/venv/bin/python
PYTEST_ARGS ?=
PYFLAKES := pyflakes3

.PHONY: setup demo test lint shim-matrix docker-slurm docker-slurm-down status stop clean install deb man
SHIM_SUITES ?= trixie sid

setup:
	NODES=$(NODES) bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

test: NODES = 3
test: setup
	$(MAKE) lint
	$(MAKE) -C spank test
	$(MAKE) shim-matrix
	$(PYTHON) -m pytest -v --durations=25 $(PYTEST_ARGS) tests/unit tests/integration tests/docker

lint:
	$(PYFLAKES) src tests

SHARE := /usr/local/share

install:
	SLURMCKPT_KEEP_CONFIG=1 bash scripts/setup.sh python spank files
	$(MAKE) man
	install -D -m 0644 build/man/slurmckpt.1 $(SHARE)/man/man1/slurmckpt.1
	install -D -m 0644 build/man/slurmckpt.yaml.5 $(SHARE)/man/man5/slurmckpt.yaml.5
	install -D -m 0644 etc/cli_filter.lua $(SHARE)/slurmckpt/cli_filter.lua

deb:
	bash scripts/build-deb.sh build

# The venv's python once set-up made it (make install), else Debian's with its python3-* packages (make deb).
MAN_PYTHON = $(if $(wildcard $(PYTHON)),$(PYTHON),/usr/bin/python3)
man:
	PYTHONPATH=src $(MAN_PYTHON) -m slurmckpt.manpage build/man

shim-matrix:
	bash scripts/shim-matrix.sh $(SHIM_SUITES)

docker-slurm:
	bash docker-slurm/cluster.sh build up demo

docker-slurm-down:
	bash docker-slurm/cluster.sh down

status:
	bash scripts/cluster.sh status

stop:
	bash scripts/cluster.sh stop

clean:
	-[ ! -f spank/Makefile ] || $(MAKE) -C spank clean
	rm -rf build dist src/*.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
