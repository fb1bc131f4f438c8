/*
 * context_remote.c - slurmstepd (remote context), after option processing.
 *
 * The --tp-spares value given to sbatch, salloc or srun reaches slurmstepd
 * through Slurm's own option forwarding; the job's environment is read
 * with spank_getenv. Same precedence as on the client side. An existing
 * TORCHPASS_SPARES is replaced only by an explicit --tp-spares, so a batch
 * script's (or tp-submit's) own export is never overridden by a default.
 */
#include <stdio.h>

#include "context.h"
#include "option.h"

struct job_env {
	spank_t sp;
	char buf[64];
};

static const char *job_getenv(const char *name, void *arg)
{
	struct job_env *env = arg;
	const char *value = NULL;

	if (spank_getenv(env->sp, name, env->buf, sizeof(env->buf)) ==
	    ESPANK_SUCCESS)
		value = env->buf;
	return value;
}

int tp_remote_post_opt(spank_t sp, const struct tp_config *cfg)
{
	int rc;
	struct tp_request req;
	struct job_env env = { .sp = sp };
	char err[TP_ERRLEN];
	char text[16];
	spank_err_t serr;

	rc = tp_resolve(cfg, tp_option_value(), job_getenv, &env, &req,
			err, sizeof(err));
	if (rc != 0) {
		slurm_error("%s", err);
	} else if (req.source != TP_FROM_NONE) {
		snprintf(text, sizeof(text), "%d", req.spares);
		serr = spank_setenv(sp, TP_ENV_SPARES, text,
				    req.source == TP_FROM_OPTION);
		if (serr != ESPANK_SUCCESS && serr != ESPANK_ENV_EXISTS) {
			slurm_error(TP_PREFIX "cannot set %s=%s for the "
				    "tasks: %s", TP_ENV_SPARES, text,
				    spank_strerror(serr));
			rc = -1;
		}
	}
	return rc;
}
