# The test suite is a package so that the rank processes (multiprocessing
# "spawn") can import job functions by reference: tests.jobs_*.<function>.
