"""``smolbench.Session``: the Workbench without IPython, for scripts, pytest, Ray tasks and asyncio.

The ``%smol`` magics are a layer over it: ``%smol up`` makes a Session, and
:func:`smolbench.session` hands it to notebook code, so that code carries over
to a script unchanged::

    with smolbench.Session(backend="sandbox") as s:
        s.run("import gymnasium as gym; env = gym.make('CartPole-v1')")
        result = s.fork(8, "obs, _ = env.reset(seed=SEED); reward = float(obs[0])")
        s.use(result.best["branch"])

Every method blocks on smolbench's own loop thread (``_loop``); each ``a``-prefixed twin
(``arun``, ``afork``, ...) awaits the same work from the caller's asyncio loop instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sys
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

from . import _args, _lifetime
from ._blocking import _block, _bridge
from ._lifetime import gone, live
from ._restoring import RestoringMixin, _restorable, _taken_back
from .errors import NOT_UP, SmolbenchError, session_phrases
from .result import VALUE, ForkResult, RunResult, Seen, run_result
from .tree import KEPT_ENDED

if TYPE_CHECKING:  # `import smolbench` stays light: backends and the gate load with the first session
    from .backends.base import Backend, Event
    from .gate.archive import Checked
    from .shelf import Shelf
    from .spec import MachineSpec
    from .workbench import Workbench

T = TypeVar("T")
P = ParamSpec("P")
BranchOutput = Callable[[str, "Event"], None]


def _pushed(values: Any) -> dict[str, bytes]:
    return pickled(_args.mapping(values, "push", "push={'data': data}"))


def _output(on_output: Any) -> BranchOutput:
    from .errors import session_notes

    given = _args.callback(on_output, "on_output", "(branch, event)")
    if not given:
        return _quiet

    def told(branch: str, event: Any) -> None:  # its own error, not the machine's (read as a malformed reply)
        try:
            given(branch, event)
        except Exception as exc:
            said = (str(exc).splitlines() or [""])[0][:200]
            raise SmolbenchError(f"on_output raised {type(exc).__name__}: {said} (the callback's error; fix it "
                                 "or pass none)") from exc

    return session_notes(told)


def pickled(values: Mapping[str, Any]) -> dict[str, bytes]:
    """``push`` values as cloudpickle bytes (what the machine loads), one-line errors otherwise."""
    import cloudpickle

    out = {}
    for name, value in values.items():
        if not str(name).isidentifier():
            raise SmolbenchError(f"--push {name!r} is not a variable name: push names like data or env",
                                 api=f"push key {name!r} is not a variable name: push names like data or env")
        try:
            out[name] = cloudpickle.dumps(value)
        except Exception as exc:
            why = f"the value can't be pickled ({type(exc).__name__}: {exc}); send something simpler"
            raise SmolbenchError(f"--push {name}: {why}", api=f"push[{name!r}]: {why}") from None
    return out


def cluster_table(path: str | None) -> dict[str, Any]:
    """The Smolfile's ``[cluster]`` table (``address = "auto"``), or {} without one."""
    if not path:
        return {}
    from .smolfile import load_cluster

    return load_cluster(path)


def choose_backend(kind: str, target: str, announce: Callable[[str], None] = print) -> tuple[Backend, str]:
    """The backend for ``backend=KIND``, and a line saying why when it fell back."""
    from .backends.process import ProcessBackend
    from .backends.sandbox import SandboxBackend, bwrap_path

    if kind == "process":
        return ProcessBackend(), ""
    if kind == "sandbox":
        return SandboxBackend(), ""  # without bwrap: an error saying how to install it
    from .backends.smol import SmolBackend

    if kind == "smol" or target == "cloud":
        return SmolBackend(target=target), ""
    from .backends.probe import probe_smol

    ok, reason = probe_smol(announce=announce)
    if ok:
        return SmolBackend(target="local"), ""
    short = reason.split(":")[0].split(" [")[0]
    if bwrap_path():
        return SandboxBackend(), f"smolbench: no microVM here ({short}; `smolbench doctor` says why); using a bubblewrap sandbox instead"
    return ProcessBackend(), (f"smolbench: WARNING: no microVM here ({short}) and no bubblewrap, so machines are PLAIN "
                              "PROCESSES with NO isolation (backend `process`): `apt-get install bubblewrap` for a sandbox")


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _in_session_words(method: Callable[P, T]) -> Callable[P, T]:
    """A public method whose SmolbenchErrors leave in the Session's words (``timeout=``, not
    ``--timeout``: :meth:`SmolbenchError.in_session_words`); the magics say theirs."""
    if asyncio.iscoroutinefunction(method):
        async def awaited(*args: P.args, **kwargs: P.kwargs) -> Any:
            try:
                return await method(*args, **kwargs)
            except SmolbenchError as exc:
                exc.in_session_words()
                raise

        return cast(Callable[P, T], functools.wraps(method)(awaited))

    @functools.wraps(method)
    def called(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(*args, **kwargs)
        except SmolbenchError as exc:
            exc.in_session_words()
            raise

    return called


class Session(RestoringMixin):
    """Machines for one program: up on ``with`` (or :meth:`up`), down when it ends.

    ``Session(smolfile=None, *, backend="auto", ray=None, ledger=None, ...)`` takes what
    ``%smol up`` takes. Leaving the ``with`` block, :meth:`down`, the interpreter's exit and
    SIGTERM or SIGHUP (outside a Jupyter kernel) each delete every machine it made.
    ``ray``: run machines on a Ray cluster's nodes (an address, ``"auto"`` or True).
    ``on_notice``: where one-line notices go, in the Session's words (default: stderr).
    """

    BACKENDS = ("auto", "smol", "sandbox", "process")

    @_in_session_words  # a magic's option said as the magics say it (`--retries 1`), the Session's as it takes it
    def __init__(self, smolfile: str | os.PathLike[str] | None = None, *, backend: str = "auto",
                 ray: str | bool | None = None, ledger: str | os.PathLike[str] | None = None, target: str = "local",
                 image: str | None = None, net: str | None = None, allow: str | None = None,
                 max_alive: int | None = None, retries: int = 1,
                 on_notice: Callable[[str], None] | None = None) -> None:
        if backend not in self.BACKENDS:
            raise SmolbenchError(f"unknown backend {backend!r}: use one of {', '.join(self.BACKENDS)}")
        if target not in ("local", "cloud"):
            raise SmolbenchError(f"unknown target {target!r}: use local or cloud")
        if net not in (None, "on", "off"):
            raise SmolbenchError(f"net must be 'on' or 'off', got {net!r}")
        if isinstance(allow, (list, tuple, set)):  # allow=["pypi.org", "10.0.0.0/8"]: what --allow a,b says
            allow = ",".join(str(a) for a in allow)
        self.smolfile = _args.path(smolfile, "smolfile", "Session('Smolfile')")
        self.backend_kind = backend
        self.ray = ray
        self.ledger_path = _args.path(ledger, "ledger", "Session(ledger='runs/ledger.db')")
        self.target = target
        self.image = _args.text(image, "image", "Session(image='debian:bookworm')")
        self.net = net
        self.allow = _args.text(allow, "allow", "Session(allow=['pypi.org'])")
        self.max_alive = _args.optional_whole(max_alive, "max_alive", example="Session(max_alive=8)")  # range: build()
        self.retries = _args.whole(retries, "--retries", 0, None, "--retries 1", "retries", "Session(retries=1)")
        self.on_notice = on_notice or _stderr_line
        self.magic_words = False  # the magics' Session: its notices name `%smol` commands, as the cells do
        self.workbench: Workbench | None = None
        self.last_result: ForkResult | None = None  # the last fork: ``use("best")`` picks its best branch
        self._forks: dict[str, str] = {}  # run id -> what to call that fork ("the fork of 8 under root at In [5]")
        self.fallback = ""  # why ``backend="auto"`` chose what it chose, when it fell back
        self.spec_path: str | None = None

    # -- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> Session:
        if not self.is_up:
            self.up()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.down()  # a Ctrl-C meanwhile lets the deletion finish (_block), then is raised
        except KeyboardInterrupt:
            if exc[0] is None or not issubclass(exc[0], KeyboardInterrupt):
                raise
            # Ctrl-C again while a Ctrl-C ends the block: the first one goes on, one traceback

    async def __aenter__(self) -> Session:
        if not self.is_up:
            await self.aup()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.adown()

    def __repr__(self) -> str:
        wb = self.workbench
        if wb is None or not wb.machines:
            return "<smolbench.Session: down>"
        return f"<smolbench.Session {wb.session}: {wb.backend.name}, active {wb.active}, {len(wb.machines)} live>"

    def __getstate__(self) -> Any:  # Ray sends a task's arguments and results pickled
        raise TypeError("a Session can't be pickled: its machines live in this process; make a Session inside the "
                        "task (`with smolbench.Session() as s:` there) and send back its results (a ForkResult travels)")

    @property
    def is_up(self) -> bool:
        """True while this session has live machines."""
        return self.workbench is not None and bool(self.workbench.machines)

    @property
    def active(self) -> str | None:
        """The node :meth:`run` runs in (None when down)."""
        return None if self.workbench is None else self.workbench.active

    def build(self, announce: Callable[[str], None] | None = None) -> Workbench:
        """Make (not yet start) the Workbench from the options: ``%smol up`` publishes it first.
        ``announce``: where the backend probe says what it is waiting for (default: notices)."""
        from .ledger import DEFAULT_PATH, Ledger
        from .workbench import Workbench

        if self.is_up:
            wb = self.workbench
            assert wb is not None
            raise SmolbenchError(f"already up ({wb.backend.name}, active {wb.active}): `%smol down` first to start over",
                                 api=f"already up ({wb.backend.name}, active {wb.active}): `Session.down()` first to "
                                 "start over")
        path, spec = self._smolfile_spec()
        file_spec = spec  # what the file says, before this session's overrides: what an edit is compared with
        if self.max_alive is not None and not 1 <= self.max_alive <= 1024:
            raise SmolbenchError(f"--max-alive must be from 1 to 1024 kept machines, got {self.max_alive}: e.g. --max-alive 8",
                                 api=f"max_alive must be from 1 to 1024 kept machines, got {self.max_alive}: e.g. "
                                 "Session(max_alive=8)")
        net_note = None
        if self.net is not None or self.allow:
            from .netpolicy import PolicyError, session_override

            try:
                spec, net_note = session_override(spec, self.net, self.allow, path or "the default spec")
            except PolicyError as exc:
                raise SmolbenchError(str(exc), api=exc.api) from None
        if self.image or self.max_alive is not None:
            spec = replace(spec, image=self.image or spec.image,
                           max_alive=spec.max_alive if self.max_alive is None else self.max_alive)
        backend: Backend
        if self.ray is not None and self.ray is not False or cluster_table(path):
            from .cluster.backend import ClusterBackend
            from .smolfile import shown

            address = self.ray if isinstance(self.ray, str) else None
            from_file = not address and path and cluster_table(path).get("address")
            named = shown(path) if from_file and path else None  # the address came from the Smolfile: errors say so
            cluster = ClusterBackend(address or cluster_table(path).get("address") or None, source=named)
            cluster.start()
            backend, self.fallback = cluster, ""
        else:
            backend, self.fallback = choose_backend(self.backend_kind, self.target, announce=announce or self.on_notice)
        wb = Workbench(backend, spec, Ledger(self.ledger_path or DEFAULT_PATH), retries=self.retries)
        wb.net_note = net_note
        wb.on_notice = self._notice_line
        if path:
            from ._smolfilewatch import SmolfileWatch

            wb.smolfile_watch = SmolfileWatch(path, file_spec)
        self.spec_path = path
        self.workbench = wb
        return wb

    def _smolfile_spec(self) -> tuple[str | None, MachineSpec]:
        """The Smolfile an up reads (its path; None: the defaults) and the spec it says."""
        from .images import home_path
        from .smolfile import load_smolfile
        from .spec import MachineSpec

        given = str(home_path(self.smolfile, "--smolfile" if self.magic_words else "smolfile")) if self.smolfile else None
        path = given or ("Smolfile" if os.path.exists("Smolfile") else None)
        if given and not os.path.exists(given):
            raise SmolbenchError(f"no Smolfile at {self.smolfile}: check the path, or drop --smolfile to use the defaults",
                                 api=f"no Smolfile at {self.smolfile}: check the path, or drop smolfile= to use the "
                                 "defaults")
        return path, (load_smolfile(path) if path else MachineSpec())

    def _room(self, checked: Checked, label: str) -> str | None:
        """Why a checkpoint holding ``checked`` can't fit in the sandbox machine an up would bring
        up for it (its Smolfile's disk and memory), or None (``_limits.room_refusal``)."""
        from .backends import _limits

        path, spec = self._smolfile_spec()
        if not _limits.ENFORCE or cluster_table(path):
            return None
        return _limits.room_refusal(spec, checked.files, checked.namespace, label, counted=bool(_limits.detect().bases))

    @_in_session_words
    def up(self) -> Session:
        """Start the root machine (and run the Smolfile's init commands). Returns the session.
        Also after its root was lost (it died under a run): a fresh root, its variables empty."""
        if not self.is_up:
            self.down()  # what is left of a session whose root was lost (its backend) goes first
        self.build()
        if self.fallback:
            self.on_notice(self.fallback)
        return self.boot()

    def boot(self, restore: str | None = None, *, waiting: Callable[[], None] | None = None) -> Session:
        """Start the machine of a :meth:`build`-made Workbench (``%smol up`` publishes it in between):
        its root, or the machine of checkpoint ``restore`` as the only one. ``waiting``: called
        every 0.2 s on this thread meanwhile (``%smol up`` shows the notices it queued)."""
        if self.workbench is None:
            raise SmolbenchError("nothing to start: call `Session.up()` (or use the session in a `with` block)")
        live(self)  # first: a SIGTERM during up() stops it and deletes what it made
        wb = self.workbench
        # (up() of a live one refuses and touches nothing; a restore's caller takes down what it
        # brought up itself, and says how that went)
        fresh = wb.active is None and restore is None
        try:
            _block(wb.up(restore), waiting=waiting)
            self._up_notes(wb)
        except BaseException:
            if fresh:  # what a stopped up made (its machine, proxy, cgroups) goes with it
                with contextlib.suppress(Exception):
                    _block(wb.down(), stoppable=False)
            gone(self)
            raise
        return self

    def _up_notes(self, wb: Workbench) -> None:
        """What an up says besides its machine (``%smol up`` prints these lines itself)."""
        if wb.disk_note and not self.magic_words:
            self._notice_line(f"smolbench: note: {wb.disk_note}")

    @_in_session_words
    async def aup(self, restore: str | None = None) -> Session:
        """:meth:`up` from an asyncio loop (``restore``: as :meth:`boot` takes it)."""
        if not self.is_up:
            await self.adown()
        wb = self.build()
        if self.fallback:
            self.on_notice(self.fallback)
        live(self)
        fresh = wb.active is None and restore is None  # (as boot())
        try:
            await _bridge(wb.up(restore))
        except BaseException:
            if fresh:  # as boot(): nothing a stopped up made stays
                with contextlib.suppress(Exception):
                    await _bridge(wb.down(), stoppable=False)
            gone(self)
            raise
        self._up_notes(wb)
        return self

    def down(self) -> int:
        """Delete every machine this session made (idempotent). Returns how many. A fork or
        episodes still running (another thread's, a task's) is cancelled first, its branches
        recorded as cancelled."""
        wb = self.workbench
        if wb is None or wb.closed:  # also after its root was lost: its backend (and zygotes) still go
            gone(self)
            return 0
        n = _block(wb.down(), stoppable=False)  # a SIGTERM meanwhile lets it finish
        gone(self)  # only now: a Ctrl-C before the deletion began leaves it to the exit hook
        return n

    close = down

    async def adown(self) -> int:
        """:meth:`down` from an asyncio loop."""
        wb = self.workbench
        if wb is None or wb.closed:
            gone(self)
            return 0
        n = await _bridge(wb.down(), stoppable=False)
        gone(self)
        return n

    aclose = adown

    def _wb(self) -> Workbench:
        if self.workbench is None or (not self.workbench.machines and self.workbench.active is None):
            raise SmolbenchError("no machine is up: run `%smol up` first", api=NOT_UP)
        return self.workbench

    # -- cells ---------------------------------------------------------------------------

    @_in_session_words
    def run(self, code: str, *, push: Mapping[str, Any] | None = None, pull: Sequence[str] | None = None,
            timeout: float | None = None, check: bool = False, node: str | None = None) -> RunResult:
        """Run ``code`` in the active machine, or in the live ``node`` (its state persists between runs).

        ``push``: values to set as variables in the machine first (cloudpickled, like ``--push``).
        ``pull``: machine variables to bring back as data (in ``result.pulled``).
        ``timeout``: interrupt the code after this many seconds (a SmolbenchError).
        The result holds what the code printed, displayed (``displays``) and the gate's
        ``notes`` on output it held back (:class:`~smolbench.result.RunResult`).
        ``check``: raise the machine's exception instead of returning it in ``result.error``
        (a RemoteError; ``except ZeroDivisionError`` catches a ``1 / 0`` too).
        Runs in different nodes may go at once (threads, or :meth:`arun` with ``asyncio.gather``).
        """
        return self._said(_block(self.cell(_args.code(code), push=_pushed(push), pull=_args.names(pull, "pull"),
                                           timeout=timeout, node=node)), check)

    @_in_session_words
    async def arun(self, code: str, *, push: Mapping[str, Any] | None = None, pull: Sequence[str] | None = None,
                   timeout: float | None = None, check: bool = False, node: str | None = None) -> RunResult:
        """:meth:`run` from an asyncio loop."""
        return self._said(await _bridge(self.cell(_args.code(code), push=_pushed(push), pull=_args.names(pull, "pull"),
                                                  timeout=timeout, node=node)), check)

    def _said(self, res: RunResult, check: bool) -> RunResult:
        if res.reward_error:
            self.on_notice(f"smolbench: {res.reward_error}: not recorded")
        if res.pull_error:
            raise SmolbenchError(res.pull_error)
        return res.raise_for_error() if check else res

    async def cell(self, code: str, *, push: dict[str, bytes] | None = None, pull: list[str] | None = None,
                   timeout: float | None = None, on_event: Callable[[Event], None] | None = None,
                   cell_name: str | None = None, first_line: int = 1, pull_trusted: bool = False,
                   value: bool = True, node: str | None = None) -> RunResult:
        """The coroutine behind :meth:`run` (on smolbench's loop), for the magics: live output
        through ``on_event``; ``value``: also bring the last expression back as data."""
        wb = self._wb()
        self._smolfile_news(wb)
        node = node or wb.active or ""
        names = list(pull or [])
        for name in names:
            if not name.isidentifier():
                raise SmolbenchError(f"{name!r} is not a variable name: give names like data or env")
        sent = dict(push or {})
        own: tuple[str, ...] = ()
        if value and VALUE not in sent and VALUE not in names:
            sent[VALUE] = pickled({VALUE: None})[VALUE]  # a run without an expression has no value
            names.append(VALUE)
            own = (VALUE,)  # not the user's push: the cell stays replayable on another node
        else:
            value = False
        seen = Seen()  # with no view (run()): its displays and notes go in the result
        res = await wb.run_cell(code, on_event or seen, push=sent, pull=names,
                                timeout=timeout, cell_name=cell_name, first_line=first_line, pull_trusted=pull_trusted,
                                node_id=node or None, own=own)
        return run_result(node, res, value, [n for n in names if not (value and n == VALUE)],
                          seen if on_event is None else None)

    # -- fan-out ---------------------------------------------------------------------------

    def fan_out(self, kind: str, n: int, code: str, *, seeds: Sequence[int] | None = None, seed_base: int | None = None,
                keep: str = "best", timeout: float | None = None, concurrency: int | None = None, retries: int = 1,
                push: dict[str, bytes] | None = None, cell_name: str | None = None,
                first_line: int = 1, reseed: bool = True) -> tuple[ForkResult, Callable[[BranchOutput], Coroutine[Any, Any, ForkResult]]]:
        """Lay out a fork (``kind="fork"``) or episodes; returns the live ForkResult and the
        coroutine that runs it given an output callback (the magics show views in between)."""
        wb = self._wb()
        self._smolfile_news(wb)
        code = _args.code(code)
        seeds_ = _args.seeds(seeds)
        if seeds_ is not None and seed_base is not None:  # one would be silently ignored
            raise SmolbenchError(f"give --seeds or --seed-base, not both: --seeds sets every branch's seed, so "
                                 f"--seed-base {seed_base} would be ignored; drop one of them",
                                 api=f"give seeds or seed_base, not both: seeds= sets every branch's seed, so "
                                 f"seed_base={seed_base!r} would be ignored; drop one of them")
        seed_base = _args.seed(0 if seed_base is None else seed_base, "seed_base")
        if concurrency is not None:
            concurrency = _args.whole(concurrency, "--concurrency", 1, None, "--concurrency 4", "concurrency", "concurrency=4")
        retries = _args.whole(retries, "--retries", 0, None, "--retries 1", "retries", "retries=1")
        if kind == "fork":
            result = wb.new_fork(n, seeds_, seed_base, timeout=timeout, concurrency=concurrency, keep=keep, reseed=reseed)
        else:
            result = wb.new_episodes(n, seeds_, seed_base, timeout=timeout, concurrency=concurrency, reseed=reseed)
        self.last_result = result
        result.magic_words = self.magic_words
        if kind == "episodes":
            result.fresh_hint = (f"episodes start fresh from {'the Smolfile' if self.spec_path else 'the default spec'}'s "
                                 f"baseline, not from the active machine {wb.active}: "
                                 f"{'`%%smol fork N`' if self.magic_words else '`Session.fork(n, code)`'} branches it")
            result.fresh_module_hint = (
                f"episodes start fresh from {'the Smolfile' if self.spec_path else 'the default spec'}'s baseline, "
                f"without what `%pip` installed in the active machine {wb.active}: list the package in "
                f"{'the' if self.spec_path else 'a'} Smolfile's `packages` (installed at up, which every episode has)")
        if kind == "fork":
            cell = (cell_name or "").strip("<>")
            self._forks[result.run_id] = (f"the fork of {len(result)} under {result.parent}"
                                          + (f" at {cell}" if cell.startswith("In [") else f" (run {result.run_id.rsplit('run', 1)[-1]})"))
            if len(self._forks) > KEPT_ENDED:  # the newest forks' names (older ones are named by run id)
                del self._forks[next(iter(self._forks))]
        def coro(on_event: BranchOutput) -> Coroutine[Any, Any, ForkResult]:
            if kind == "fork":
                return wb.fork(result, code, on_event, timeout=timeout, concurrency=concurrency, keep=keep,
                               push=push, retries=retries, cell_name=cell_name, first_line=first_line)
            return wb.episodes(result, code, on_event, timeout=timeout, concurrency=concurrency, push=push,
                               retries=retries, cell_name=cell_name, first_line=first_line)

        return result, coro

    @_in_session_words
    def fork(self, n: int, code: str, *, seeds: Sequence[int] | None = None, seed_base: int | None = None, keep: str = "best",
             timeout: float | None = None, concurrency: int | None = None, retries: int = 1,
             push: Mapping[str, Any] | None = None, allow_errors: bool = False,
             on_output: BranchOutput | None = None, reseed: bool = True) -> ForkResult:
        """Run ``code`` in ``n`` copy-on-write branches of the active machine, each with its own ``SEED``.

        ``seeds`` (else ``seed_base + 0..n-1``, from 0 when not given; giving both is an error);
        ``keep``: best, all or none stay alive;
        ``retries``: branch again a machine that failed to boot or died (never a code error);
        ``reseed=False``: leave the random streams made before the fork as they are (all branches alike);
        ``on_output(branch, event)``: each branch's output as it comes (``event.text``).
        Raises a CompositeError when any branch failed, unless ``allow_errors`` (its ``.result``: this ForkResult)."""
        result, coro = self.fan_out("fork", n, code, seeds=seeds, seed_base=seed_base, keep=keep, timeout=timeout,
                                    concurrency=concurrency, retries=retries, push=_pushed(push), reseed=reseed)
        return _checked(_block(coro(_output(on_output)), result), allow_errors)

    @_in_session_words
    async def afork(self, n: int, code: str, *, seeds: Sequence[int] | None = None, seed_base: int | None = None,
                    keep: str = "best", timeout: float | None = None, concurrency: int | None = None,
                    retries: int = 1, push: Mapping[str, Any] | None = None, allow_errors: bool = False,
                    on_output: BranchOutput | None = None, reseed: bool = True) -> ForkResult:
        """:meth:`fork` from an asyncio loop."""
        result, coro = self.fan_out("fork", n, code, seeds=seeds, seed_base=seed_base, keep=keep, timeout=timeout,
                                    concurrency=concurrency, retries=retries, push=_pushed(push), reseed=reseed)
        return _checked(await _bridge(coro(_output(on_output)), result), allow_errors)

    @_in_session_words
    def episodes(self, n: int, code: str, *, seeds: Sequence[int] | None = None, seed_base: int | None = None,
                 timeout: float | None = None, concurrency: int | None = None, retries: int = 1,
                 push: Mapping[str, Any] | None = None, allow_errors: bool = False,
                 on_output: BranchOutput | None = None, reseed: bool = True) -> ForkResult:
        """Run ``code`` once per seed, each in a fresh machine from the baseline, deleted after
        (``seeds`` or ``seed_base`` as :meth:`fork` takes them; a CompositeError as there, its ``.result`` this ForkResult)."""
        result, coro = self.fan_out("episodes", n, code, seeds=seeds, seed_base=seed_base, timeout=timeout,
                                    concurrency=concurrency, retries=retries, push=_pushed(push), reseed=reseed)
        return _checked(_block(coro(_output(on_output)), result), allow_errors)

    @_in_session_words
    async def aepisodes(self, n: int, code: str, *, seeds: Sequence[int] | None = None, seed_base: int | None = None,
                        timeout: float | None = None, concurrency: int | None = None, retries: int = 1,
                        push: Mapping[str, Any] | None = None, allow_errors: bool = False,
                        on_output: BranchOutput | None = None, reseed: bool = True) -> ForkResult:
        """:meth:`episodes` from an asyncio loop."""
        result, coro = self.fan_out("episodes", n, code, seeds=seeds, seed_base=seed_base, timeout=timeout,
                                    concurrency=concurrency, retries=retries, push=_pushed(push), reseed=reseed)
        return _checked(await _bridge(coro(_output(on_output)), result), allow_errors)

    # -- the tree ------------------------------------------------------------------------

    @_in_session_words
    def use(self, node: str) -> str:
        """Make a live node the active machine: e.g. ``root.7``, or ``best``: the last fork's best
        branch, or when that is gone (or it has none) the best live rewarded branch of this
        session's forks, and a notice says which fork that came from."""
        if node == "best":
            node, note = best_alive(self._wb(), self.last_result, self._forks)
            if note:
                self._notice_line(f"smolbench: {note}")
        return self._wb().use(node).id

    @_in_session_words
    def delete(self, node: str) -> list[str]:
        """Delete a node's machine and every live machine below it; returns their ids."""
        return _block(self._wb().delete(node))

    @_in_session_words
    async def adelete(self, node: str) -> list[str]:
        """:meth:`delete` from an asyncio loop."""
        return await _bridge(self._wb().delete(node))

    @_in_session_words
    def checkpoint_save(self, name: str | None = None, *, node: str | None = None, force: bool = False) -> dict[str, Any]:
        """Save a live node's whole machine (default: the active one); returns name, node, path, size,
        warnings (each also told through ``on_notice``: what could not be saved is gone at a restore)."""
        return self._saved(_block(self._wb().checkpoint_save(_args.text(name, "name", "checkpoint_save('lesson')"), node,
                                                             force)))

    def _saved(self, info: dict[str, Any]) -> dict[str, Any]:
        for w in info.get("warnings", []):
            self.on_notice(f"smolbench: warning: {w}")
        return info

    @_in_session_words
    async def acheckpoint_save(self, name: str | None = None, *, node: str | None = None,
                               force: bool = False) -> dict[str, Any]:
        """:meth:`checkpoint_save` from an asyncio loop."""
        return self._saved(await _bridge(self._wb().checkpoint_save(_args.text(name, "name", "checkpoint_save('lesson')"),
                                                                    node, force)))

    @_in_session_words
    def checkpoint_restore(self, name_or_path: str | os.PathLike[str]) -> str:
        """A new machine from a checkpoint, made active; returns its node id. ``name_or_path``:
        a checkpoint saved here, or the path of a ``.smolcheckpoint`` file (copied in and
        checked first; a file from elsewhere is restored only on an isolating backend). With
        nothing up, it brings up the backend the checkpoint was made on (as ``%smol checkpoint
        restore`` does) with the restored machine as its only one, and takes it down again if
        the restore fails; a file it would refuse (cut short, damaged) is refused before any
        machine starts."""
        return self._restored(self._restore(_restorable(name_or_path)))

    @_in_session_words
    async def acheckpoint_restore(self, name_or_path: str | os.PathLike[str]) -> str:
        """:meth:`checkpoint_restore` from an asyncio loop (:meth:`_restore`'s steps, awaited)."""
        what = _restorable(name_or_path)
        started = not self.is_up
        try:
            if started:
                with self._backend_for(what):
                    await self.aup(restore=what)
                wb = self._wb()
                node = wb.active
                assert node is not None
            else:
                wb = self._wb()
                node = (await _bridge(wb.checkpoint_restore(what))).id
        except BaseException:
            if started:
                try:
                    took: int | Exception = await self.adown()
                except Exception as exc:
                    took = exc
                _taken_back(took, self._notice, self.workbench)
            raise
        return self._restored(node, wb)

    def _smolfile_news(self, wb: Workbench) -> None:
        """Say, once, that the Smolfile changed since the up (a stat per call): the machines keep the old one."""
        line = wb.smolfile_watch.news() if wb.smolfile_watch is not None else None
        if line is not None:
            self._notice_line(line)

    def _notice_line(self, line: str) -> None:
        """A Workbench's one-line news, its commands in the words of whoever made this Session."""
        self.on_notice(line if self.magic_words else session_phrases(line))

    def status(self) -> dict[str, Any]:
        """What ``%smol status`` shows, as a dict (``{"up": False, "lost": None}`` when down). ``lost``: the
        last machine that died under a run (exited, crashed, ran out of memory, or was killed
        for ignoring its timeout), or that this call found dead while idle (killed from
        outside), and why (None when none was); when that was the root, nothing is up until
        :meth:`up` starts a fresh one."""
        wb = self.workbench
        if wb is not None and not wb.closed and wb.machines:
            _block(wb.notice_gone())  # a machine killed while idle is lost, not shown alive
        lost = {"lost": wb.last_loss if wb is not None and not wb.closed and wb.last_loss else None}
        if wb is None or not wb.machines:
            return {"up": False, **lost}
        _block(wb.refresh_network())
        status = wb.status()
        if not self.magic_words:  # "`%smol trust off`": said as the call that does it
            status["trusted"] = session_phrases(status["trusted"])
        return {"up": True, **status, **lost}

    @_in_session_words
    def ledger(self) -> Any:
        """This session's ledger (``.nodes()``, ``.runs()``, ... as DataFrames)."""
        return self._wb().ledger

    @_in_session_words
    def checkpoints(self) -> list[dict[str, Any]]:
        """This folder's checkpoints, newest first, as ``%smol checkpoint list`` shows them (also
        with nothing up): name, backend, file, whether it exists, why it can't be used."""
        with self._shelf() as shelf:
            return shelf.rows()

    @_in_session_words
    def checkpoint_rm(self, name: str) -> str:
        """Forget checkpoint ``name`` and delete its file here (also with nothing up); what happened."""
        name = _args.text(name, "name", "checkpoint_rm('lesson')") or ""
        if self.is_up:
            return self._wb().checkpoint_remove(name)
        with self._shelf() as shelf:
            return shelf.remove(name)

    @_in_session_words
    def checkpoint_trust(self, name: str) -> str:
        """Sign checkpoint ``name`` of this folder as your own save (also with nothing up), as
        ``%smol checkpoint trust`` does: a row not signed as yours (a copied folder's, another
        user's, or one saved before smolbench signed rows) is refused on smol and restored
        elsewhere as a file from someone else. Its file is checked as one from elsewhere first
        (a smol microVM's can't be: trust only one you saved). What happened."""
        name = _args.text(name, "name", "checkpoint_trust('lesson')") or ""
        if self.is_up:
            return self._wb().checkpoint_trust(name)
        with self._shelf() as shelf:
            return shelf.trust(name, "")

    @_in_session_words
    def checkpoint_export(self, name: str, path: str | os.PathLike[str], *, force: bool = False) -> dict[str, Any]:
        """Write checkpoint ``name`` to ``path`` (``….smolcheckpoint``) as one file, its record
        inside, that :meth:`checkpoint_restore` takes in any folder; returns its size, and
        ``note``: what students need besides it (the Smolfile it was made with, its packages), or None."""
        dest = _args.path(path, "path", "checkpoint_export('lesson', 'lesson.smolcheckpoint')") or ""
        spec = self.workbench.spec if self.is_up and self.workbench is not None else None
        with self._shelf() as shelf:
            return shelf.export(_args.text(name, "name", "checkpoint_export('lesson', PATH)") or "", dest, spec, force)

    @contextlib.contextmanager
    def _shelf(self) -> Iterator[Shelf]:
        """This folder's checkpoints: the Workbench's, or its ledger's while nothing is up."""
        from .ledger import DEFAULT_PATH, Ledger
        from .shelf import Shelf

        if self.is_up and self.workbench is not None:
            yield self.workbench.shelf
            return
        ledger = Ledger(self.ledger_path or DEFAULT_PATH)
        try:
            yield Shelf(ledger)
        finally:
            ledger.close()

    @_in_session_words
    def replay(self, node: str, *, on_output: BranchOutput | None = None) -> dict[str, Any]:
        """Rebuild ``node``'s path (from its nearest live or checkpointed ancestor, in temporary
        branches deleted after) with its recorded cells and seeds, as ``%smol replay`` does; returns
        node, reward, recorded, match, notes, message. A smolbench.gym episode is refused (its
        actions are not recorded)."""
        return _block(self._wb().replay(_args.text(node, "node", "replay('root.3')") or "", _output(on_output)))

    @_in_session_words
    async def areplay(self, node: str, *, on_output: BranchOutput | None = None) -> dict[str, Any]:
        """:meth:`replay` from an asyncio loop."""
        return await _bridge(self._wb().replay(_args.text(node, "node", "replay('root.3')") or "", _output(on_output)))


def best_alive(wb: Workbench, last: ForkResult | None, forks: Mapping[str, str]) -> tuple[str, str]:
    """What ``use("best")`` makes active, and the line to say when it is not the last fork's
    winner: the best live rewarded branch of this session's forks (``forks``: what the ones run
    through the Session are called). None: a one-line SmolbenchError saying why."""
    from .tree import best_key

    def called(run_id: str, parent: str | None) -> str:  # (a fork from the tree view's button has no entry)
        return forks.get(run_id) or f"the fork {run_id.rsplit('/', 1)[-1]} under {parent}"

    mine = last if last is not None and last.kind == "fork" and last.run_id.startswith(wb.session + "/") else None
    best = mine.best if mine is not None else None
    if best is not None and best["branch"] in wb.machines:
        return best["branch"], ""
    rewarded = [n for n in wb.tree if n.run_id and n.parent is not None and n.reward is not None and n.status == "ok"]
    alive = [n for n in rewarded if n.id in wb.machines]
    if not rewarded and mine is None:
        raise SmolbenchError("no fork with a rewarded branch yet: run `%%smol fork N` first, or name a node "
                             "(`%smol tree`)", api="no fork with a rewarded branch yet: call `Session.fork(n, "
                             "code)` first, or name a live node (`Session.status()['live_machines']`)")
    if mine is None:
        why = "the last run was not a fork"
    elif best is not None:
        why = f"the last fork's best, {best['branch']}, was deleted"
    else:
        failed = ", ".join(f"{v} {k}" for k, v in sorted(mine.counts().items()) if k != "ok")
        why = f"{called(mine.run_id, mine.parent)} has no rewarded branch" + (f" ({failed})" if failed else "")
    if not alive:
        others = [n for n in rewarded if mine is None or n.run_id != mine.run_id]
        gone = "; no other fork's rewarded branch is alive" if others else ""
        raise SmolbenchError(f"no live rewarded branch to use: {why}{gone}: `%smol replay NODE` rebuilds one, or name a "
                             "live node (`%smol tree`)",
                             api=f"no live rewarded branch to use: {why}{gone}: `Session.replay(node)` rebuilds one, "
                             "or name a live node (`Session.status()['live_machines']`)")
    pick = min(alive, key=lambda n: best_key(n.id, n.reward))
    return pick.id, (f"{why}: using the best live rewarded branch, {pick.id} (reward {pick.reward:.6g}), from "
                     f"{called(str(pick.run_id), pick.parent)}")


# -- results --------------------------------------------------------------------------------


def _checked(result: ForkResult, allow_errors: bool) -> ForkResult:
    if not allow_errors:
        result.raise_for_errors()
    return result


def _quiet(branch: str, ev: Event) -> None:
    """Branch output is kept in each row's ``output``; nothing is printed."""


def current() -> Session:
    """The live Session made last: in a notebook, the one ``%smol up`` made."""
    return cast(Session, _lifetime.current())
