/*
 * step.c - identify the step and task the plugin runs for (remote context).
 */
#include <stdio.h>

#include <slurm/slurm.h>

#include "slurmckpt.h"

static int get_step_id(spank_t sp, uint32_t *step_id)
{
	spank_err_t rc;

	rc = spank_get_item(sp, S_JOB_STEPID, step_id);
	if (rc != ESPANK_SUCCESS) {
		slurm_error("slurmckpt: step: S_JOB_STEPID: %s", spank_strerror(rc));
		return (-1);
	}
	return (0);
}

int step_wrappable(spank_t sp)
{
	uint32_t step_id;

	if (get_step_id(sp, &step_id) < 0)
		return (-1);
	if (step_id == SLURM_BATCH_SCRIPT)
		return (1);
	/* extern, interactive, pending and other special steps */
	return (step_id <= SLURM_MAX_NORMAL_STEP_ID);
}

int step_info_get(spank_t sp, struct step_info *si)
{
	uint32_t step_id;
	spank_err_t rc;
	const char *what;
	int rv = -1;

	if (get_step_id(sp, &step_id) < 0)
		goto fail;
	what = "S_JOB_ID";
	if ((rc = spank_get_item(sp, S_JOB_ID, &si->job_id)) != ESPANK_SUCCESS)
		goto fail_item;
	what = "S_TASK_GLOBAL_ID";
	if ((rc = spank_get_item(sp, S_TASK_GLOBAL_ID, &si->rank)) != ESPANK_SUCCESS)
		goto fail_item;
	what = "S_SLURM_RESTART_COUNT";
	if ((rc = spank_get_item(sp, S_SLURM_RESTART_COUNT, &si->restart_count)) != ESPANK_SUCCESS)
		goto fail_item;
	what = "S_JOB_UID";
	if ((rc = spank_get_item(sp, S_JOB_UID, &si->uid)) != ESPANK_SUCCESS)
		goto fail_item;
	what = "S_JOB_GID";
	if ((rc = spank_get_item(sp, S_JOB_GID, &si->gid)) != ESPANK_SUCCESS)
		goto fail_item;
	if (step_id == SLURM_BATCH_SCRIPT)
		snprintf(si->step, sizeof(si->step), "batch");
	else
		snprintf(si->step, sizeof(si->step), "%u", step_id);
	rv = 0;
	goto fail;
fail_item:
	slurm_error("slurmckpt: step: %s: %s", what, spank_strerror(rc));
fail:
	return (rv);
}
