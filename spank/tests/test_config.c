/*
 * test_config.c - unit test of config.c: plugstack.conf parsing, bounds,
 * and the precedence command line > environment > plugstack default.
 * Links config.c alone (no Slurm). Run by `make check`.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "config.h"

static int failures;
static int checks;

#define CHECK(cond, ...)                                                   \
	do {                                                               \
		checks++;                                                  \
		if (!(cond)) {                                             \
			failures++;                                        \
			fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
			fprintf(stderr, __VA_ARGS__);                      \
			fputc('\n', stderr);                               \
		}                                                          \
	} while (0)

/* A fake environment: NULL-terminated name, value pairs. */
static const char *fake_getenv(const char *name, void *arg)
{
	const char *const *pairs = arg;
	const char *value = NULL;
	int i;

	for (i = 0; pairs && pairs[i] != NULL && value == NULL; i += 2)
		if (strcmp(pairs[i], name) == 0)
			value = pairs[i + 1];
	return value;
}

static int parse(struct tp_config *cfg, char *err, int argc, ...)
{
	char *argv[8];
	va_list ap;
	int i;

	va_start(ap, argc);
	for (i = 0; i < argc; i++)
		argv[i] = va_arg(ap, char *);
	va_end(ap);
	err[0] = '\0';
	return tp_config_parse(cfg, argc, argv, err, TP_ERRLEN);
}

static int contains(const char *text, const char *part)
{
	return strstr(text, part) != NULL;
}

static void test_defaults(void)
{
	struct tp_config cfg;
	char err[TP_ERRLEN];

	CHECK(parse(&cfg, err, 0) == 0, "no arguments: %s", err);
	CHECK(cfg.default_spares == 0 && cfg.min_spares == 0 &&
	      cfg.max_spares == TP_DEFAULT_MAX,
	      "defaults 0/0/%d, got %d/%d/%d", TP_DEFAULT_MAX,
	      cfg.default_spares, cfg.min_spares, cfg.max_spares);
	CHECK(parse(&cfg, err, 3, "default=1", "min=1", "max=4") == 0,
	      "all three: %s", err);
	CHECK(cfg.default_spares == 1 && cfg.min_spares == 1 &&
	      cfg.max_spares == 4, "1/1/4, got %d/%d/%d",
	      cfg.default_spares, cfg.min_spares, cfg.max_spares);
	CHECK(parse(&cfg, err, 1, "min=2") == 0, "min alone: %s", err);
	CHECK(cfg.default_spares == 2, "default follows min, got %d",
	      cfg.default_spares);
}

static void test_bad_config(void)
{
	struct tp_config cfg;
	char err[TP_ERRLEN];

	CHECK(parse(&cfg, err, 1, "spares=1") != 0, "unknown key accepted");
	CHECK(contains(err, "torchpass: unknown plugstack.conf setting "
		       "'spares=1'") && contains(err, "default=N, min=N and max=N"),
	      "unknown key message: %s", err);
	CHECK(parse(&cfg, err, 1, "maximum=3") != 0, "prefix key accepted");
	CHECK(parse(&cfg, err, 1, "max") != 0 && contains(err, "no value"),
	      "key without value: %s", err);
	CHECK(parse(&cfg, err, 2, "max=3", "max=4") != 0 &&
	      contains(err, "twice"), "repeated key: %s", err);
	CHECK(parse(&cfg, err, 1, "max=-1") != 0 &&
	      contains(err, "not a number"), "negative: %s", err);
	CHECK(parse(&cfg, err, 1, "max=2x") != 0, "trailing junk accepted");
	CHECK(parse(&cfg, err, 1, "max=") != 0 && contains(err, "empty"),
	      "empty value: %s", err);
	CHECK(parse(&cfg, err, 1, "max=1025") != 0 &&
	      contains(err, "hard limit"), "above limit: %s", err);
	CHECK(parse(&cfg, err, 1, "max=99999999999999") != 0,
	      "overflow accepted");
	CHECK(parse(&cfg, err, 2, "min=3", "max=2") != 0 &&
	      contains(err, "min=3 is above max=2"), "min > max: %s", err);
	CHECK(parse(&cfg, err, 2, "default=5", "max=4") != 0 &&
	      contains(err, "default=5 is outside min=0..max=4"),
	      "default > max: %s", err);
	CHECK(parse(&cfg, err, 2, "default=0", "min=1") != 0,
	      "default < min accepted");
	CHECK(strncmp(err, TP_PREFIX, strlen(TP_PREFIX)) == 0,
	      "message without prefix: %s", err);
}

static void test_precedence(void)
{
	struct tp_config cfg;
	struct tp_request req;
	char err[TP_ERRLEN];
	const char *both[] = { "SBATCH_TP_SPARES", "3",
			       "TORCHPASS_SPARES", "2", NULL };
	const char *runtime[] = { "TORCHPASS_SPARES", "2", NULL };
	const char *empty[] = { "SBATCH_TP_SPARES", "", NULL };
	const char *bad[] = { "TORCHPASS_SPARES", "two", NULL };

	parse(&cfg, err, 3, "default=1", "min=0", "max=4");

	CHECK(tp_resolve(&cfg, "4", fake_getenv, (void *)both, &req,
			 err, sizeof(err)) == 0 && req.spares == 4 &&
	      req.source == TP_FROM_OPTION, "option wins: %s", err);
	CHECK(tp_resolve(&cfg, NULL, fake_getenv, (void *)both, &req,
			 err, sizeof(err)) == 0 && req.spares == 3 &&
	      req.source == TP_FROM_ENV &&
	      strcmp(req.env_name, "SBATCH_TP_SPARES") == 0,
	      "SBATCH_TP_SPARES before TORCHPASS_SPARES: %d", req.spares);
	CHECK(tp_resolve(&cfg, NULL, fake_getenv, (void *)runtime, &req,
			 err, sizeof(err)) == 0 && req.spares == 2 &&
	      req.source == TP_FROM_ENV, "TORCHPASS_SPARES: %d", req.spares);
	CHECK(tp_resolve(&cfg, NULL, fake_getenv, (void *)empty, &req,
			 err, sizeof(err)) == 0 && req.spares == 1 &&
	      req.source == TP_FROM_DEFAULT, "empty env is unset: %d",
	      req.spares);
	CHECK(tp_resolve(&cfg, NULL, fake_getenv, NULL, &req,
			 err, sizeof(err)) == 0 && req.spares == 1 &&
	      req.source == TP_FROM_DEFAULT, "default: %d", req.spares);
	CHECK(tp_resolve(&cfg, "0", fake_getenv, (void *)both, &req,
			 err, sizeof(err)) == 0 && req.spares == 0 &&
	      req.source == TP_FROM_OPTION, "explicit 0 wins");
	CHECK(tp_resolve(&cfg, NULL, fake_getenv, (void *)bad, &req,
			 err, sizeof(err)) != 0 &&
	      contains(err, "TORCHPASS_SPARES='two' is not a number"),
	      "bad env value: %s", err);

	parse(&cfg, err, 0);
	CHECK(tp_resolve(&cfg, NULL, fake_getenv, NULL, &req,
			 err, sizeof(err)) == 0 && req.source == TP_FROM_NONE,
	      "nothing asked, default 0: no export");
}

static void test_bounds(void)
{
	struct tp_config cfg;
	struct tp_request req;
	char err[TP_ERRLEN];
	const char *high[] = { "TORCHPASS_SPARES", "9", NULL };

	parse(&cfg, err, 2, "min=1", "max=4");
	CHECK(tp_resolve(&cfg, "5", NULL, NULL, &req, err, sizeof(err)) != 0 &&
	      contains(err, "torchpass: --tp-spares=5 is above this cluster's "
		       "maximum of 4"), "ceiling: %s", err);
	CHECK(tp_resolve(&cfg, "0", NULL, NULL, &req, err, sizeof(err)) != 0 &&
	      contains(err, "--tp-spares=0 is below this cluster's minimum "
		       "of 1"), "floor: %s", err);
	CHECK(tp_resolve(&cfg, NULL, fake_getenv, (void *)high, &req,
			 err, sizeof(err)) != 0 &&
	      contains(err, "TORCHPASS_SPARES=9 is above"),
	      "env is bounded too: %s", err);
	CHECK(tp_resolve(&cfg, "abc", NULL, NULL, &req, err, sizeof(err)) != 0 &&
	      contains(err, "--tp-spares='abc' is not a number"),
	      "syntax: %s", err);
	CHECK(tp_resolve(&cfg, "+1", NULL, NULL, &req, err, sizeof(err)) != 0,
	      "sign accepted");
	CHECK(tp_resolve(&cfg, " 1", NULL, NULL, &req, err, sizeof(err)) != 0,
	      "space accepted");
	CHECK(tp_resolve(&cfg, "4", NULL, NULL, &req, err, sizeof(err)) == 0 &&
	      req.spares == 4, "max itself is allowed: %s", err);
	CHECK(tp_resolve(&cfg, "1", NULL, NULL, &req, err, sizeof(err)) == 0 &&
	      req.spares == 1, "min itself is allowed: %s", err);
}

int main(void)
{
	test_defaults();
	test_bad_config();
	test_precedence();
	test_bounds();
	if (failures == 0)
		printf("torchpass: test_config: %d checks passed\n", checks);
	else
		fprintf(stderr, "torchpass: test_config: %d of %d checks "
			"failed\n", failures, checks);
	return failures == 0 ? 0 : 1;
}
