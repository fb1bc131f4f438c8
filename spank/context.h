/*
 * context.h - what the plugin does in each SPANK context. torchpass.c
 * routes each callback here; each context has its own file.
 */
#ifndef TORCHPASS_CONTEXT_H
#define TORCHPASS_CONTEXT_H

#include <slurm/spank.h>

#include "config.h"

/*
 * sbatch, salloc (S_CTX_ALLOCATOR) and srun (S_CTX_LOCAL), after the
 * options: resolve the spare count, refuse a bad one, and export it
 * (context_client.c).
 */
int tp_client_post_opt(spank_t sp, const struct tp_config *cfg);

/*
 * slurmstepd (S_CTX_REMOTE), after the options: put TORCHPASS_SPARES in
 * the tasks' environment (context_remote.c).
 */
int tp_remote_post_opt(spank_t sp, const struct tp_config *cfg);

#endif /* TORCHPASS_CONTEXT_H */
