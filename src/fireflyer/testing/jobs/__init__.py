"""Scripts that the tests and benchmarks submit as platform tasks, run by path
(``python .../jobs/platform_job.py ...``): see :data:`fireflyer.testing.live_platform.JOB`."""
