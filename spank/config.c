/*
 * config.c - plugstack.conf parsing, bounds, and the precedence
 * command line > environment > plugstack.conf default.
 *
 * No Slurm here, so that tests/test_config.c can link it alone.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "config.h"

#define TP_MAX_DIGITS 9 /* keeps any accepted value far from INT_MAX */

static void set_error(char *err, size_t errlen, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static void set_error(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;
	int n;

	n = snprintf(err, errlen, "%s", TP_PREFIX);
	if (n >= 0 && (size_t)n < errlen) {
		va_start(ap, fmt);
		vsnprintf(err + n, errlen - (size_t)n, fmt, ap);
		va_end(ap);
	}
}

void tp_config_defaults(struct tp_config *cfg)
{
	cfg->default_spares = TP_DEFAULT_SPARES;
	cfg->min_spares = TP_DEFAULT_MIN;
	cfg->max_spares = TP_DEFAULT_MAX;
}

int tp_parse_count(const char *text, const char *what, int *out,
		   char *err, size_t errlen)
{
	int rc = -1;
	int value = 0;
	size_t len = text ? strlen(text) : 0;
	size_t i;

	if (len == 0) {
		set_error(err, errlen, "%s is empty: give a number of spare "
			  "nodes from 0 to %d", what, TP_SPARES_LIMIT);
	} else if (len > TP_MAX_DIGITS ||
		   strspn(text, "0123456789") != len) {
		set_error(err, errlen, "%s='%.40s' is not a number of spare "
			  "nodes: give a whole number from 0 to %d",
			  what, text, TP_SPARES_LIMIT);
	} else {
		for (i = 0; i < len; i++)
			value = value * 10 + (text[i] - '0');
		if (value > TP_SPARES_LIMIT) {
			set_error(err, errlen, "%s=%s is above the hard limit "
				  "of %d spare nodes", what, text,
				  TP_SPARES_LIMIT);
		} else {
			*out = value;
			rc = 0;
		}
	}
	return rc;
}

int tp_check_bounds(const struct tp_config *cfg, int count, const char *what,
		    char *err, size_t errlen)
{
	int rc = -1;

	if (count < cfg->min_spares) {
		set_error(err, errlen, "%s=%d is below this cluster's minimum "
			  "of %d spare node(s) (plugstack.conf min=%d): ask "
			  "for at least %d", what, count, cfg->min_spares,
			  cfg->min_spares, cfg->min_spares);
	} else if (count > cfg->max_spares) {
		set_error(err, errlen, "%s=%d is above this cluster's maximum "
			  "of %d spare node(s) (plugstack.conf max=%d): ask "
			  "for at most %d", what, count, cfg->max_spares,
			  cfg->max_spares, cfg->max_spares);
	} else {
		rc = 0;
	}
	return rc;
}

/* Which setting `key` names: its slot in cfg and its bit in `seen`. */
static int *config_slot(struct tp_config *cfg, const char *key, size_t keylen,
			unsigned *bit)
{
	int *slot = NULL;

	if (keylen == 7 && strncmp(key, "default", 7) == 0) {
		slot = &cfg->default_spares;
		*bit = 1u;
	} else if (keylen == 3 && strncmp(key, "min", 3) == 0) {
		slot = &cfg->min_spares;
		*bit = 2u;
	} else if (keylen == 3 && strncmp(key, "max", 3) == 0) {
		slot = &cfg->max_spares;
		*bit = 4u;
	}
	return slot;
}

/* One "key=value" argument into cfg; `seen` catches repeated keys. */
static int parse_argument(struct tp_config *cfg, const char *arg,
			  unsigned *seen, char *err, size_t errlen)
{
	int rc = -1;
	const char *eq = strchr(arg, '=');
	size_t keylen = eq ? (size_t)(eq - arg) : strlen(arg);
	unsigned bit = 0;
	int *slot = config_slot(cfg, arg, keylen, &bit);
	char what[32];

	if (slot == NULL) {
		set_error(err, errlen, "unknown plugstack.conf setting '%.40s': "
			  "the settings are default=N, min=N and max=N", arg);
	} else if (eq == NULL) {
		set_error(err, errlen, "plugstack.conf setting '%s' has no "
			  "value: write %s=N", arg, arg);
	} else if (*seen & bit) {
		set_error(err, errlen, "plugstack.conf gives '%.*s' twice: "
			  "keep one", (int)keylen, arg);
	} else {
		snprintf(what, sizeof(what), "plugstack.conf %.*s",
			 (int)keylen, arg);
		rc = tp_parse_count(eq + 1, what, slot, err, errlen);
		*seen |= bit;
	}
	return rc;
}

int tp_config_parse(struct tp_config *cfg, int argc, char **argv,
		    char *err, size_t errlen)
{
	int rc = 0;
	unsigned seen = 0;
	int i;

	tp_config_defaults(cfg);
	for (i = 0; i < argc && rc == 0; i++)
		rc = parse_argument(cfg, argv[i], &seen, err, errlen);
	if (rc == 0 && !(seen & 1u))
		cfg->default_spares = cfg->min_spares; /* default follows the floor */
	if (rc == 0 && cfg->min_spares > cfg->max_spares) {
		set_error(err, errlen, "plugstack.conf min=%d is above max=%d",
			  cfg->min_spares, cfg->max_spares);
		rc = -1;
	} else if (rc == 0 && (cfg->default_spares < cfg->min_spares ||
			       cfg->default_spares > cfg->max_spares)) {
		set_error(err, errlen, "plugstack.conf default=%d is outside "
			  "min=%d..max=%d", cfg->default_spares,
			  cfg->min_spares, cfg->max_spares);
		rc = -1;
	}
	return rc;
}

/* The first of TP_ENV_INPUTS that is set (and not empty), or NULL. */
static const char *find_env(tp_getenv_f getenv_fn, void *arg,
			    const char **name)
{
	static const char *const names[] = TP_ENV_INPUTS;
	const char *value = NULL;
	int i;

	for (i = 0; names[i] != NULL && value == NULL; i++) {
		value = getenv_fn ? getenv_fn(names[i], arg) : NULL;
		if (value != NULL && value[0] == '\0')
			value = NULL;
		if (value != NULL)
			*name = names[i];
	}
	return value;
}

int tp_resolve(const struct tp_config *cfg, const char *option,
	       tp_getenv_f getenv_fn, void *getenv_arg,
	       struct tp_request *req, char *err, size_t errlen)
{
	int rc = 0;
	const char *env_name = NULL;
	const char *env_value = NULL;
	const char *what = "--tp-spares";

	req->spares = cfg->default_spares;
	req->source = cfg->default_spares > 0 ? TP_FROM_DEFAULT : TP_FROM_NONE;
	req->env_name = NULL;
	if (option == NULL)
		env_value = find_env(getenv_fn, getenv_arg, &env_name);
	if (option != NULL) {
		rc = tp_parse_count(option, what, &req->spares, err, errlen);
		req->source = TP_FROM_OPTION;
	} else if (env_value != NULL) {
		what = env_name;
		rc = tp_parse_count(env_value, what, &req->spares, err, errlen);
		req->source = TP_FROM_ENV;
		req->env_name = env_name;
	}
	if (rc == 0 && req->source != TP_FROM_NONE)
		rc = tp_check_bounds(cfg, req->spares,
				     req->source == TP_FROM_DEFAULT ?
				     "plugstack.conf default" : what,
				     err, errlen);
	return rc;
}

const char *tp_source_name(enum tp_source source)
{
	const char *name = "nothing";

	switch (source) {
	case TP_FROM_OPTION:
		name = "the command line";
		break;
	case TP_FROM_ENV:
		name = "the environment";
		break;
	case TP_FROM_DEFAULT:
		name = "the plugstack.conf default";
		break;
	case TP_FROM_NONE:
		break;
	}
	return name;
}
