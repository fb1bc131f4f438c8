/*
 * config.h - torchpass SPANK plugin: plugstack.conf settings and the
 * resolution of the spare count (command line > environment > default).
 *
 * Pure C, no Slurm headers: tests/test_config.c links config.c alone.
 */
#ifndef TORCHPASS_CONFIG_H
#define TORCHPASS_CONFIG_H

#include <stddef.h>

/* Every message the plugin prints starts with this. */
#define TP_PREFIX "torchpass: "

/* Hard limit on any spare count, whatever plugstack.conf says. */
#define TP_SPARES_LIMIT 1024

/* plugstack.conf defaults: no spares unless asked, at most 64. */
#define TP_DEFAULT_SPARES 0
#define TP_DEFAULT_MIN 0
#define TP_DEFAULT_MAX 64

/* Enough room for any message of this plugin. */
#define TP_ERRLEN 512

/* The job environment variable the runtime reads (runtime-contract.md). */
#define TP_ENV_SPARES "TORCHPASS_SPARES"

/* Environment variables read, first found wins, when --tp-spares is absent. */
#define TP_ENV_INPUTS { "SBATCH_TP_SPARES", TP_ENV_SPARES, NULL }

struct tp_config {
	int default_spares; /* plugstack.conf default= */
	int min_spares;     /* plugstack.conf min= (admin floor) */
	int max_spares;     /* plugstack.conf max= (admin ceiling) */
};

enum tp_source {
	TP_FROM_NONE = 0,   /* nothing asked and default 0: set nothing */
	TP_FROM_OPTION,     /* --tp-spares on the command line */
	TP_FROM_ENV,        /* one of TP_ENV_INPUTS */
	TP_FROM_DEFAULT     /* plugstack.conf default= (> 0) */
};

struct tp_request {
	int spares;            /* the resolved count */
	enum tp_source source; /* where it came from */
	const char *env_name;  /* for TP_FROM_ENV: which variable */
};

/* Looks a variable up; returns NULL when unset. */
typedef const char *(*tp_getenv_f)(const char *name, void *arg);

/* Defaults: default=0 min=0 max=64. */
void tp_config_defaults(struct tp_config *cfg);

/*
 * Parse the plugstack.conf arguments ("default=1", "min=0", "max=4").
 * Unknown or repeated keys, values that are not integers in
 * [0, TP_SPARES_LIMIT], and min <= default <= max violated are errors.
 * Returns 0, or -1 with a message in err.
 */
int tp_config_parse(struct tp_config *cfg, int argc, char **argv,
		    char *err, size_t errlen);

/*
 * A spare count as a user wrote it: decimal digits only, at most
 * TP_SPARES_LIMIT. `what` names its origin in the message
 * ("--tp-spares", "SBATCH_TP_SPARES"). Returns 0, or -1 with err set.
 */
int tp_parse_count(const char *text, const char *what, int *out,
		   char *err, size_t errlen);

/* count within [min, max] of cfg? Returns 0, or -1 with err set. */
int tp_check_bounds(const struct tp_config *cfg, int count, const char *what,
		    char *err, size_t errlen);

/*
 * The spare count of this job: `option` (the --tp-spares value, or NULL)
 * wins over the environment (TP_ENV_INPUTS through `getenv_fn`), which wins
 * over cfg->default_spares. The result is bounds-checked. Returns 0, or -1
 * with err set.
 */
int tp_resolve(const struct tp_config *cfg, const char *option,
	       tp_getenv_f getenv_fn, void *getenv_arg,
	       struct tp_request *req, char *err, size_t errlen);

/* "the command line", "the environment" or "the plugstack.conf default". */
const char *tp_source_name(enum tp_source source);

#endif /* TORCHPASS_CONFIG_H */
