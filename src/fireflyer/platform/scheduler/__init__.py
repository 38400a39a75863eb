"""The scheduler: the ``daemon`` that every tick watches the running attempts, asks the policy and acts,
and the ``api``, what users may do with the platform, as plain data (the one core under the commands and
the HTTP server).
"""
