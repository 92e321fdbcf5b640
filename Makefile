# slurmckpt: top-level targets. Everything runs as root (it installs packages and starts a Slurm test cluster).
#   make setup [NODES=3]   packages, CRIU, venv, SPANK plugin, config, running cluster (scripts/setup.sh)
#   make demo              setup, then scripts/demo.sh
#   make test              setup with 3 nodes (one slurmd per network namespace), then the linter, the
#                          shim's C unit tests (make -C spank test, then shim-matrix), the unit and integration
#                          tests (single-node ones run on node1..3, multi-node ones need 3), then test-2411
#   make test-2411         a subset of the integration tests against Slurm 24.11: a Debian 13 root (cached in
#                          /var/cache/slurmckpt/roots/trixie) with its own namespaces and daemons
#                          (scripts/slurm-suite.sh; which tests and why: docs/slurm-versions.md); part of make test
#   make shim-matrix       the shim built and its C unit tests run against Debian trixie's (24.11) and sid's
#                          (newest) Slurm headers, downloaded to /var/cache/slurmckpt (scripts/shim-matrix.sh)
#   make lint              pyflakes over src/ and tests/ (Debian's pyflakes3, installed by setup)
#   make status | stop     cluster status / stop every daemon of the test cluster
#   make clean             remove build artefacts from the tree (the cluster and installed files stay)
NODES ?= 1
PYTHON := /opt/slurmckpt/venv/bin/python
PYTEST_ARGS ?=
PYFLAKES := pyflakes3

.PHONY: setup demo test test-2411 lint shim-matrix status stop clean
SHIM_SUITES ?= trixie sid
# What runs on Slurm 24.11 (docs/slurm-versions.md says why these): about 7 minutes of tests.
IT := tests/integration
TESTS_2411 ?= $(IT)/test_launch_form.py \
  $(IT)/test_checkpoint_restore.py::test_requeue_twice_resumes_mid_run_with_exact_output \
  $(IT)/test_checkpoint_restore.py::test_srun_step_ranks_restore_and_exit_codes_reach_sacct \
  $(IT)/test_checkpoint_restore.py::test_bad_interval_values_are_rejected_at_submission \
  '$(IT)/test_signals.py::test_requeue_sigterm_never_reaches_a_program_that_handles_it[proctrack/cgroup]' \
  $(IT)/test_slurm_view.py::test_slurm_tracks_accounts_and_limits_a_checkpointed_job_before_and_after_restore \
  $(IT)/test_fresh_start_reasons.py::test_a_job_requeued_before_any_commit_says_no_checkpoint_committed_yet \
  $(IT)/test_security_launch.py::test_loader_variables_from_sbatch_export_never_reach_a_privileged_process \
  $(IT)/test_mpi.py::test_mpich_srun_pmi2_on_one_node_requeued_twice_equals_an_uninterrupted_run

setup:
	NODES=$(NODES) bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

test: NODES = 3
test: setup
	$(MAKE) lint
	$(MAKE) -C spank test
	$(MAKE) shim-matrix
	$(PYTHON) -m pytest -v --durations=25 $(PYTEST_ARGS) tests/unit tests/integration
	$(MAKE) test-2411

test-2411:
	bash scripts/slurm-suite.sh trixie -- --durations=10 $(TESTS_2411)

lint:
	$(PYFLAKES) src tests

shim-matrix:
	bash scripts/shim-matrix.sh $(SHIM_SUITES)

status:
	bash scripts/cluster.sh status

stop:
	bash scripts/cluster.sh stop

clean:
	-[ ! -f spank/Makefile ] || $(MAKE) -C spank clean
	rm -rf build dist src/*.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
