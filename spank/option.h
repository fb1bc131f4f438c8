/*
 * option.h - the --tp-spares option of sbatch, salloc and srun.
 */
#ifndef TORCHPASS_OPTION_H
#define TORCHPASS_OPTION_H

#include <slurm/spank.h>

#include "config.h"

/*
 * Register --tp-spares (call from slurm_spank_init only). Values given to
 * it are checked against `cfg`, which must outlive the plugin.
 */
int tp_option_register(spank_t sp, const struct tp_config *cfg);

/* The checked --tp-spares value as given, or NULL when it was not given. */
const char *tp_option_value(void);

#endif /* TORCHPASS_OPTION_H */
