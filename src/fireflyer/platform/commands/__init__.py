"""The platform's commands: ``dispatch`` routes ``fireflyer platform ...`` and the task commands; ``admin`` is
``fireflyer platform start|stop|status|quota|group``, ``serve`` is ``fireflyer platform serve|user`` (the HTTP
server and its users), ``tasks`` is ``fireflyer submit|queue|describe|logs|suspend|resume|stop|nodes|drain|
undrain``, ``remote`` the same over HTTP (``--server``), and ``render`` how they all print.
"""
