#!/bin/sh
# ssh for the simulated hosts of tests/netns.py, as mpiexec's -launcher-exec:
# "netns_ssh.sh [-x] HOST COMMAND..." runs COMMAND in HOST's network, UTS and
# IPC namespaces (those of the SimulatedHosts tagged $PYCOLL_TEST_SIM_TAG),
# from /, as ssh would start it on HOST.
while [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
tag=${PYCOLL_TEST_SIM_TAG:?PYCOLL_TEST_SIM_TAG is not set}
exec nsenter --net="/run/netns/pycoll-$host-$tag" --uts="/run/pycoll-sim-$tag/$host.uts" \
    --ipc="/run/pycoll-sim-$tag/$host.ipc" --wd=/ -- sh -c "$*"
