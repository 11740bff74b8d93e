"""The topology matrix's job (tests/support/topology_job.py; run by tests/checkpoint/test_topology_matrix.py)."""

from topology_job import main

main()
