"""The flamed daemon: continuous sampling, rotating files, metrics, control socket.

Modules, one job each:

* :mod:`~flamed.daemon.config` -- TOML config, frozen dataclasses, validation.
* :mod:`~flamed.daemon.core` -- :class:`Daemon`: the parts put together, lifecycle, status.
* :mod:`~flamed.daemon.loop` -- the main loop: drains, windows, rotation, flush hand-off.
* :mod:`~flamed.daemon.sampler_stats` -- the sampler's own stats into metrics and status.
* :mod:`~flamed.daemon.reload` -- SIGHUP: the configuration applied section by section.
* :mod:`~flamed.daemon.handlers` -- control-socket requests and the pprof pull endpoint.
* :mod:`~flamed.daemon.store` -- rotating folded files, sidecars, retention.
* :mod:`~flamed.daemon.ring` -- recent windows in memory, for snapshots.
* :mod:`~flamed.daemon.metrics` -- Prometheus metrics and their HTTP server.
* :mod:`~flamed.daemon.control` / :mod:`~flamed.daemon.protocol` -- the Unix socket.
* :mod:`~flamed.daemon.client` -- the client side (``flamed snapshot``/``status``/``flush``).
* :mod:`~flamed.daemon.processors` -- the hook for window processors (mixed mode).
* :mod:`~flamed.daemon.notify` / :mod:`~flamed.daemon.logs` -- systemd integration.
* :mod:`~flamed.daemon.fake` -- a synthetic sampler for tests and demos.
"""
