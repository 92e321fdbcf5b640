# slurmckpt: top-level targets. Everything runs as root (it installs packages and starts a Slurm test cluster).
#   make setup [NODES=3]   packages, CRIU, venv, SPANK plugin, config, running cluster (scripts/setup.sh)
#   make demo              setup, then scripts/demo.sh
#   make test              setup with 3 nodes (one slurmd per network namespace), then the linter, the
#                          shim's C unit tests (make -C spank test, then shim-matrix), the unit and integration
#                          tests (single-node ones run on node1..3, multi-node ones need 3), with the
#                          Slurm 24.11 and 26.05 subsets (test-2411, test-2605) and the docker-slurm test
#                          (tests/docker) running beside the host cluster's suite (scripts/test-suites.sh)
#   make test-2411         a subset of the integration tests against Slurm 24.11: a Debian 13 root (cached in
#                          /var/cache/slurmckpt/roots/trixie) with its own namespaces and daemons
#                          (scripts/slurm-suite.sh; which tests and why: docs/slurm-versions.md); part of make test
#   make test-2605         the suite's core and what 25.11/26.05 change, against Slurm 26.05: a Debian sid root
#                          (/var/cache/slurmckpt/roots/sid), the same way; part of make test, beside test-2411
#   make shim-matrix       the shim built and its C unit tests run against Debian trixie's (24.11) and sid's
#                          (newest) Slurm headers, downloaded to /var/cache/slurmckpt (scripts/shim-matrix.sh)
#   make install           on a cluster node: the venv in /opt/slurmckpt/venv with the package, the plugins and the
#                          namespace init in /usr/local, the config template where none exists, directories, man
#                          pages, cli_filter.lua and `slurmckpt gc` hourly (a systemd timer, else /etc/cron.d;
#                          scripts/gc-schedule.sh) (setup.sh's install steps; no test cluster, no packages)
#   make deb               build/slurmckpt_<version>_<arch>.deb with dpkg-deb (scripts/build-deb.sh)
#   make man               build/man/slurmckpt.1 and slurmckpt.yaml.5, generated from the code
#   make unit              the inner loop: pyflakes, mypy and the unit tests, no cluster, no root, nothing
#                          installed but Python and the package's test extra (scripts/unit.sh; under 2 minutes)
#   make lint              pyflakes over src/ and tests/ (Debian's pyflakes3), mypy strict over src/ (the venv's,
#                          pinned; both installed by setup)
#   make docker-slurm      no root needed with Docker: the container test cluster of docker-slurm/ built and started,
#                          the demo run in it (a job restored on the other node); make docker-slurm-down stops
#                          it (docker-slurm/cluster.sh, docs/docker-slurm.md)
#   make status | stop     cluster status / stop every daemon of the test cluster
#   make clean             remove build artefacts from the tree (the cluster and installed files stay)
NODES ?= 1
PYTHON := /opt/slurmckpt/venv/bin/python
PYTEST_ARGS ?=
PYFLAKES := pyflakes3

.PHONY: setup demo test unit test-2411 test-2605 lint shim-matrix docker-slurm docker-slurm-down status stop clean install deb man
SHIM_SUITES ?= trixie sid
# The integration tests are spread over three clusters that run side by side (docs/slurm-versions.md): the host's
# Slurm 22.05 (3 nodes), a Debian 13 root's Slurm 24.11 and a Debian sid root's Slurm 26.05 (1 node each).
# TESTS_CORE run on 22.05 and 26.05, TESTS_BOTH on 22.05 and 24.11; the single-node files of TESTS_2411_ONLY run
# on 24.11 alone and TESTS_2605_ONLY on 26.05 alone (the host suite ignores both), everything else on 22.05 alone.
IT := tests/integration
TESTS_2411_ONLY ?= $(IT)/test_restore_paths.py $(IT)/test_ipc_pair.py $(IT)/test_security_isolation.py \
  $(IT)/test_fresh_start_reasons.py $(IT)/test_programs.py $(IT)/test_security.py $(IT)/test_network_lock.py \
  $(IT)/test_interval_auto.py
# single tests that run on 24.11 alone (the host suite deselects them): they balance the two suites' time
TESTS_2411_ONLY_IDS ?= $(IT)/test_checkpoint_restore.py::test_preemption_captures_within_gracetime_and_resumes \
  $(IT)/test_checkpoint_restore.py::test_walltime_capture_and_requeue_without_user_signal \
  $(IT)/test_store.py::test_capture_over_quota_is_refused_job_runs_on_and_restores_the_previous_commit \
  $(IT)/test_cli_and_gres.py::test_manual_checkpoint_then_inspect_then_requeue_via_cli \
  '$(IT)/test_signals.py::test_requeue_sigterm_never_reaches_a_program_that_handles_it[proctrack/linuxproc]' \
  $(IT)/test_mpi.py::test_a_rank_waiting_in_a_pmi_barrier_is_not_captured_and_the_job_restores_after_it \
  $(IT)/test_checkpoint_restore.py::test_failed_capture_keeps_job_running_and_previous_checkpoint \
  $(IT)/test_slurm_view.py::test_memory_limit_holds_for_a_restored_workload \
  $(IT)/test_cli_and_gres.py::test_gres_gpu_job_has_its_own_proc_and_restores_while_its_old_host_pids_are_taken \
  $(IT)/test_cli_and_gres.py::test_checkpoint_of_a_job_not_under_slurmckpt_is_refused_and_the_job_lives \
  $(IT)/test_security_launch.py::test_working_directory_is_entered_as_the_user \
  $(IT)/test_security_launch.py::test_user_can_touch_neither_the_init_directory_nor_the_freeze_control \
  $(IT)/test_security_launch.py::test_a_tree_its_user_holds_frozen_dies_with_the_job_on_a_v1_freezer \
  $(IT)/test_security_launch.py::test_output_fd_the_user_cannot_read_is_never_copied \
  $(IT)/test_security_launch.py::test_special_file_stdout_is_not_copied
TESTS_2411 ?= $(TESTS_2411_ONLY) $(TESTS_2411_ONLY_IDS) $(TESTS_BOTH)
TESTS_BOTH ?= $(IT)/test_launch_form.py \
  $(IT)/test_checkpoint_restore.py::test_bad_interval_values_are_rejected_at_submission \
  $(IT)/test_security_launch.py::test_loader_variables_from_sbatch_export_never_reach_a_privileged_process
# the core: capture/restore and requeue twice, srun steps, signals, Slurm's view, one MPI row
TESTS_CORE ?= $(IT)/test_checkpoint_restore.py::test_requeue_twice_resumes_mid_run_with_exact_output \
  $(IT)/test_checkpoint_restore.py::test_srun_step_ranks_restore_and_exit_codes_reach_sacct \
  '$(IT)/test_signals.py::test_requeue_sigterm_never_reaches_a_program_that_handles_it[proctrack/cgroup]' \
  $(IT)/test_slurm_view.py::test_slurm_tracks_accounts_and_limits_a_checkpointed_job_before_and_after_restore \
  $(IT)/test_mpi.py::test_mpich_srun_pmi2_on_one_node_requeued_twice_equals_an_uninterrupted_run
TESTS_2605_ONLY ?= $(IT)/test_slurm_releases.py $(IT)/test_security_names.py $(IT)/test_host_copy_criu.py \
  $(IT)/test_gpu_transports.py $(IT)/test_io_uring.py $(IT)/test_kill_window.py $(IT)/test_security_tcp_holds.py
TESTS_2605 ?= $(TESTS_2605_ONLY) $(TESTS_CORE) $(IT)/test_launch_form.py \
  $(IT)/test_fresh_start_reasons.py::test_a_job_requeued_before_any_commit_says_no_checkpoint_committed_yet

setup:
	NODES=$(NODES) bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

test: NODES = 3
test: setup
	bash scripts/timed.sh "torch venv" bash scripts/setup.sh torch
	[ -n "$(SLURMCKPT_UNIT_DONE)" ] || bash scripts/timed.sh lint $(MAKE) lint
	bash scripts/timed.sh "shim tests" $(MAKE) -C spank test
	bash scripts/timed.sh "shim matrix" $(MAKE) shim-matrix
	PYTHON=$(PYTHON) PYTEST_ARGS="$(PYTEST_ARGS)" TESTS_2411="$(TESTS_2411)" TESTS_2605="$(TESTS_2605)" \
	  SLURMCKPT_UNIT_DONE="$(SLURMCKPT_UNIT_DONE)" \
	  HOST_IGNORE="$(addprefix --ignore=,$(TESTS_2411_ONLY) $(TESTS_2605_ONLY)) $(addprefix --deselect=,$(TESTS_2411_ONLY_IDS))" \
	  bash scripts/test-suites.sh

test-2411:
	bash scripts/slurm-suite.sh trixie -- --durations=10 $(TESTS_2411)

test-2605:
	bash scripts/slurm-suite.sh sid -- --durations=10 $(TESTS_2605)

lint:
	$(PYFLAKES) src tests
	$(PYTHON) -m mypy

unit:
	bash scripts/unit.sh

SHARE := /usr/local/share

install:
	SLURMCKPT_KEEP_CONFIG=1 bash scripts/setup.sh python spank files gc-schedule
	$(MAKE) man
	install -D -m 0644 build/man/slurmckpt.1 $(SHARE)/man/man1/slurmckpt.1
	install -D -m 0644 build/man/slurmckpt.yaml.5 $(SHARE)/man/man5/slurmckpt.yaml.5
	install -D -m 0644 etc/cli_filter.lua $(SHARE)/slurmckpt/cli_filter.lua

deb:
	bash scripts/build-deb.sh build

# The venv's python once set-up made it (make install), else Debian's with its python3-* packages (make deb).
MAN_PYTHON = $(if $(wildcard $(PYTHON)),$(PYTHON),/usr/bin/python3)
man:
	PYTHONPATH=src $(MAN_PYTHON) -m slurmckpt.cli.manpage build/man

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
