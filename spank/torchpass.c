/*
 * torchpass.c - the torchpass SPANK plugin: dispatch only.
 *
 * Adds --tp-spares=N to sbatch, salloc and srun and carries the value to
 * the job as TORCHPASS_SPARES. Each SPANK context is handled in its own
 * file (context_client.c, context_remote.c); plugstack.conf settings are
 * parsed in config.c, the option lives in option.c. See README.md and
 * docs/design/spank.md.
 */
#include <slurm/spank.h>

#include "config.h"
#include "context.h"
#include "option.h"

SPANK_PLUGIN(torchpass, 1);

static struct tp_config plugin_config;

/* The contexts in which the plugin acts; elsewhere (slurmd, prolog) it is idle. */
static int active_context(void)
{
	spank_context_t ctx = spank_context();

	return ctx == S_CTX_ALLOCATOR || ctx == S_CTX_LOCAL ||
	       ctx == S_CTX_REMOTE;
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	int rc = 0;
	char err[TP_ERRLEN];

	if (active_context()) {
		rc = tp_config_parse(&plugin_config, ac, av, err, sizeof(err));
		if (rc != 0)
			slurm_error("%s (the plugin refuses to load)", err);
		else
			rc = tp_option_register(sp, &plugin_config);
	}
	return rc;
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	int rc = 0;

	(void)ac;
	(void)av;
	switch (spank_context()) {
	case S_CTX_ALLOCATOR:
	case S_CTX_LOCAL:
		rc = tp_client_post_opt(sp, &plugin_config);
		break;
	case S_CTX_REMOTE:
		rc = tp_remote_post_opt(sp, &plugin_config);
		break;
	default:
		break;
	}
	return rc;
}
