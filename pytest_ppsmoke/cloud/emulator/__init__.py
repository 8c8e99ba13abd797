"""``pp-fake-vast``: an emulator of vast.ai's REST API whose instances are local node processes.

    from pytest_ppsmoke.cloud.emulator.server import FakeVast

    async with FakeVast(faults="vast.reject_create=2") as vast:   # vast.url, vast.api_key
        ...  # a VastClient, pp-smoke-run --vast-url, or the official vastai CLI

It serves the paths, methods, JSON fields, status values and error codes that vast.ai serves
(as its official client, ``vastai`` 1.9, calls them): ``POST /api/v0/bundles/`` (offers from a
catalogue, filtered by the query's ``{field: {op: value}}`` and ordered), ``PUT
/api/v0/asks/{id}/`` (create), ``GET``/``PUT``/``DELETE /api/v0/instances/{id}/`` (show, label,
destroy), ``GET /api/v0/instances/`` and the
paginated ``GET /api/v1/instances/``. Every call needs ``Authorization: Bearer <key>``.

An instance is a ``pp-gpu-node`` process started with the create call's ``env`` plus what
vast.ai's host agent gives a container (``NodeEnv.container_id`` and ``container_api_key``, a key
that may act on that instance only) and ``vast_url``. Its ``actual_status`` goes null -> ``loading`` ->
``running`` (process started) -> ``exited`` (process gone). A record also carries vast.ai's
``intended_status`` (what the owner wants: running, stopped once destroyed), ``cur_state`` (the
contract: running while its container lives) and ``next_state`` (where it is headed); an instance
whose process crashed is ``exited`` but still intended running. Destroy kills its process group and
frees the offer; destroying an unknown instance is HTTP 404 ``not_found`` ("Instance not found"),
vast.ai's way of saying it is gone. Closing the emulator kills whatever is left, and the nodes
also exit when the emulator's process dies (stdin EOF), so nothing outlives it.

``runtime="image"`` (``--runtime image``) runs each instance as vast.ai does: a working container
of the image the create call names, run by buildah (:mod:`.runtimes`).

Faults are failpoints (``pytest_ppsmoke/failpoints.py``, the ``vast.*`` points), one or more for
each row of the spec's error table: ``FakeVast(faults=...)`` takes them in PP_FAILPOINTS's form or
as a mapping; without it, the emulator takes this process's (PP_FAILPOINTS, ``failpoints.scoped``).
Instances are picked by their stage (``NodeEnv.stage`` in the create call's env), create calls by
their number (1-based). Symptoms only a node can show are switched on in that node's environment
(``NodeEnv.failpoints``). vast.ai's own misbehaviour, each off by default but its rate limits:

- ``vast.rate_limit`` (on by default: ``documented``, the table ``cloud/vastdoc.py`` reads from
  vast.ai's OpenAPI files, at ``PP_VAST_TIME_SCALE``; ``off`` for none): per endpoint and per
  identity (the key and the client's address: the account key and a container's key count
  apart), a call within the endpoint's threshold of the last one let through gets HTTP 429, and
  so does every call for the penalty that follows; the body is the documented JSON
  (``{"detail": "API requests too frequent endpoint threshold=4.5"}``), with no Retry-After.
- ``vast.race_offers``: that create call finds its offer rented by someone else between search and
  create: HTTP 404 ``no_such_ask`` ("Offer N is not available") or 410 ("... is no longer
  available"); the offer stays rented, so later searches no longer return it.
- ``vast.destroy_linger``: a destroyed instance stays listed (show and both lists) that long, going
  away (``intended_status`` and ``next_state`` "stopped"; ``cur_state`` "running" until its process
  has ended, then "stopped"; ``actual_status`` as the process is: running, then exited); destroying
  it again answers success. :meth:`.server.FakeVast.live` leaves it out: it is destroyed.
- ``vast.destroy_ignored``: a destroy answered success that does nothing (still running, intended
  running).
- ``vast.lose_host``: mid-run (after ``vast.kill_after_tokens`` sampled tokens) a stage's host dies:
  ``offline`` freezes its node's process group (SIGSTOP; "host N stopped answering"), ``exited``
  kills it ("host N failed"); intended still running. A destroy then kills the node at once (no
  stop grace). In the image runtime the same signals go to ``buildah run``'s process group, which
  holds the container's processes (chroot isolation).

The package, one concern a module: :mod:`.server` (``FakeVast``: the emulator's state, its start
and close, ``pp-fake-vast``'s main), :mod:`.api` (the routes, authentication, the faults at the
door), :mod:`.catalogue` (offers and matching), :mod:`.instances` (the instance record and its
life), :mod:`.runtimes` (what an instance is: one class per runtime, named in :mod:`.registry`),
:mod:`.faults` (the fault gate's rules and the host-loss scheduler).

This module and :mod:`.registry` import only the standard library.
"""

NETWORK_PATH = "/ppsmoke/network"  # the emulator's own path: the emulated network's host address
