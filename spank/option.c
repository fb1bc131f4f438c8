/*
 * option.c - the --tp-spares option: registration and its callback.
 *
 * Slurm calls the callback in sbatch/salloc/srun (remote == 0) and again
 * in slurmstepd (remote == 1) with the value the user gave. It may also
 * call it twice on one side (from SLURM_SPANK_* environment variables and
 * from the command line); the last value wins.
 */
#include <stdio.h>
#include <string.h>

#include "option.h"

#define TP_OPTION_VAL 1

static const struct tp_config *option_cfg;
static char option_text[16];
static int option_given;

static int spares_cb(int val, const char *optarg, int remote);

static struct spank_option spares_option = {
	"tp-spares",
	"N",
	"Reserve N hot-spare nodes for torchpass live migration "
	"(exported to the job as TORCHPASS_SPARES).",
	1,
	TP_OPTION_VAL,
	spares_cb,
};

static int spares_cb(int val, const char *optarg, int remote)
{
	int rc = -1;
	int count = 0;
	char err[TP_ERRLEN];

	(void)val;
	(void)remote;
	if (option_cfg == NULL) {
		slurm_error(TP_PREFIX "--tp-spares seen before the plugin was "
			    "initialised");
	} else if (tp_parse_count(optarg, "--tp-spares", &count,
				  err, sizeof(err)) != 0 ||
		   tp_check_bounds(option_cfg, count, "--tp-spares",
				   err, sizeof(err)) != 0) {
		slurm_error("%s", err);
	} else {
		snprintf(option_text, sizeof(option_text), "%d", count);
		option_given = 1;
		rc = 0;
	}
	return rc;
}

int tp_option_register(spank_t sp, const struct tp_config *cfg)
{
	int rc = 0;
	spank_err_t err;

	option_cfg = cfg;
	option_given = 0;
	err = spank_option_register(sp, &spares_option);
	if (err != ESPANK_SUCCESS) {
		slurm_error(TP_PREFIX "cannot register --tp-spares: %s",
			    spank_strerror(err));
		rc = -1;
	}
	return rc;
}

const char *tp_option_value(void)
{
	return option_given ? option_text : NULL;
}
