#!/bin/sh
# Start one node of the torchpass-slurm test cluster.
#   tp-node-entrypoint controller   munged + slurmctld (the login node too)
#   tp-node-entrypoint compute      munged + slurmd
# The Slurm daemon runs in the foreground as the container's main process.
set -eu

role="${1:-compute}"

install -d -o munge -g munge -m 0755 /run/munge
runuser -u munge -- /usr/sbin/munged --force

for _ in $(seq 50); do
    [ -S /run/munge/munge.socket.2 ] && break
    sleep 0.1
done

case "$role" in
    controller)
        exec /usr/sbin/slurmctld -D -i
        ;;
    compute)
        exec /usr/sbin/slurmd -D
        ;;
    *)
        echo "tp-node-entrypoint: unknown role '$role' (expected controller or compute)" >&2
        exit 64
        ;;
esac
