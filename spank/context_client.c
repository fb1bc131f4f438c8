/*
 * context_client.c - sbatch, salloc (allocator context) and srun (local
 * context), after option processing.
 *
 * The resolved count goes to two places:
 *  - this process's environment (TORCHPASS_SPARES): sbatch copies it into
 *    the job (--export=ALL, the default), salloc's shell and srun's tasks
 *    inherit it;
 *  - the job control environment (spank_job_control_setenv): slurmctld's
 *    job_submit.lua reads it from job_desc.spank_job_env to add the spare
 *    nodes, and Prolog/Epilog see it as SPANK_TORCHPASS_SPARES.
 */
#include <stdio.h>
#include <stdlib.h>

#include "context.h"
#include "option.h"

static const char *process_getenv(const char *name, void *arg)
{
	(void)arg;
	return getenv(name);
}

/* Export `text` in both environments (see the top of this file). */
static int export_spares(spank_t sp, const char *text)
{
	int rc = 0;
	spank_err_t err;

	if (setenv(TP_ENV_SPARES, text, 1) != 0) {
		slurm_error(TP_PREFIX "cannot set %s=%s in the environment",
			    TP_ENV_SPARES, text);
		rc = -1;
	}
	err = spank_job_control_setenv(sp, TP_ENV_SPARES, text, 1);
	if (rc == 0 && err != ESPANK_SUCCESS) {
		/* srun inside an allocation has no job to describe: note it */
		if (spank_context() == S_CTX_ALLOCATOR) {
			slurm_error(TP_PREFIX "cannot pass %s=%s to the "
				    "controller: %s", TP_ENV_SPARES, text,
				    spank_strerror(err));
			rc = -1;
		} else {
			slurm_verbose(TP_PREFIX "job control environment not "
				      "set (%s)", spank_strerror(err));
		}
	}
	return rc;
}

int tp_client_post_opt(spank_t sp, const struct tp_config *cfg)
{
	int rc;
	struct tp_request req;
	char err[TP_ERRLEN];
	char text[16];

	rc = tp_resolve(cfg, tp_option_value(), process_getenv, NULL, &req,
			err, sizeof(err));
	if (rc != 0) {
		slurm_error("%s", err);
	} else if (req.source != TP_FROM_NONE) {
		snprintf(text, sizeof(text), "%d", req.spares);
		slurm_verbose(TP_PREFIX "%d spare node(s), from %s%s%s",
			      req.spares, tp_source_name(req.source),
			      req.env_name ? " " : "",
			      req.env_name ? req.env_name : "");
		rc = export_spares(sp, text);
	}
	return rc;
}
