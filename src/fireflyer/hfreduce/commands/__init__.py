"""hfreduce's commands: ``fireflyer hfreduce clean|trace`` (``admin``) and ``fireflyer hfreduce demo``
(``demo``, which runs ``demo_job`` under torchrun).
"""
