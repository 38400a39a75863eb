"""The scheduler: the ``daemon`` that every tick watches the running attempts, asks the policy and acts
(reading what the attempts' supervisors report, ``reports``, and saying how its cycles go, ``health``),
run as one process per home by ``service`` (``pidlock``); and the ``api``, what users may do with the
platform, as plain data (the one core under the commands and the HTTP server).
"""
