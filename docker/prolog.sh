#!/bin/sh
# Prolog of the test cluster. The nodes have no GPUs: a test gives a node
# simulated ones by writing /shared/health/<node>.json (format: docs/admin-guide.md);
# then the real torchpass prolog (installed by `tp health install` in the image)
# checks them and drains the node on CRITICAL. Without that file there is nothing
# to check, and the prolog returns at once.
sim="/shared/health/$(hostname).json"
[ -e "$sim" ] || exit 0
TORCHPASS_HEALTH_SIMULATE="$sim" exec /opt/torchpass-health/torchpass-prolog.sh
