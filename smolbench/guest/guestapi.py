"""The ``smolbench_guest`` module that cells import inside the machine.

Stdlib only, Python 3.8+: runs inside the machine (see ``agent.py``).
"""

import select
import sys
import types

from . import protocol as P
from .output import mime_bundle

CHANNEL_LINE = P.CHANNEL_LINE
# A gym step with a Discrete action, as the host writes it (smolbench/gym/requests.py
# _action_line), and the answer to one that goes on with an empty info: made and read here
# without JSON (the same bytes protocol.encode/decode would make and read; a test holds
# them equal), as most steps are these. Any other request or answer goes the JSON way.
STEP_HEAD, STEP_TAIL = b'{"op":"step","a":{"$":"int64","v":', b'}}\n'
LEAN_HEAD = b'{"t":"answer","step":{"o":"'
LEAN_TAIL = b'","r":%s,"f":0,"i":{"format":"data","data":{"$":"dict","v":[]}}}}\n'


FRAMES = 100  # the last frames of an answered error's traceback sent (a RecursionError has 1,000)


def _frames(error):
    """``error``'s traceback as a cell's error sends it (``traceback.format_list``'s lines),
    without the serving loop's own frames: the leading ones of the file whose code caught it
    (a gym env's ``Server.serve``), so it starts where the code it called raised (the env's
    ``step``). None of those: an error of the serving code itself, sent without frames."""
    tb = error.__traceback__
    own = tb.tb_frame.f_code.co_filename if tb is not None else None
    while tb is not None and tb.tb_frame.f_code.co_filename == own:
        tb = tb.tb_next
    if tb is None:
        return []
    import traceback  # here, not at start-up: an error's path only

    return traceback.format_list(traceback.extract_tb(tb, limit=-FRAMES))


class GuestAPI(types.ModuleType):
    """The ``smolbench_guest`` module that cells can import inside the machine."""

    def __init__(self, agent):
        super().__init__("smolbench_guest", "Talk to smolbench from inside a machine.")
        self._agent = agent

    def report(self, reward=None, **metrics):
        """Record this branch's reward and any extra metrics (numbers or short strings)."""
        if reward is not None:
            self._agent.reported["reward"] = reward
        self._agent.reported.setdefault("metrics", {}).update(metrics)

    def display(self, *objs):
        """Show objects in the notebook, like IPython's display()."""
        for obj in objs:
            self._agent.outbox.flush()  # text printed before the display shows before it
            self._agent.send({"t": "display", "data": mime_bundle(obj)})

    def pip(self, *args):
        """Run ``python -m pip ARGS`` in this machine (installs go to its own folder on sys.path)."""
        from . import pipsite

        return pipsite.run(args)

    def _pip_line(self, *args):
        """A cell's ``%pip ARGS`` line: pip's output in the cell, no value, no raise (IPython's)."""
        self.pip(*args)

    def _pip_text(self, text):
        """A cell's ``%pip`` line with ``{expr}`` / ``$name`` in it: filled in from the cell's
        variables (its caller's frame, as IPython's var_expand), then run as ``_pip_line``."""
        import shlex

        from . import pipsite

        frame = sys._getframe(1)
        ns = dict(frame.f_globals)
        ns.update(frame.f_locals)
        del frame
        try:
            args = shlex.split(pipsite.expand(text, ns), comments=True)
        except ValueError as err:
            sys.stderr.write("smolbench: this pip line did not run: %s\n" % err)
            return
        self.pip(*args)

    @property
    def node(self):
        """This machine's node id in the fork tree (e.g. ``root.3``)."""
        return self._agent.name

    @property
    def seed(self):
        """This branch's seed, or None on a machine that was never seeded."""
        return self._agent.seed


    def channel(self):
        """This cell's own connection to the host, kept open for a loop of small requests
        (``smolbench.gym`` steps an env this way, without a new connection per step).

        Returns ``(requests, answer)``: ``requests`` yields each JSON request the host sends
        after the cell's own and ends when the host hangs up (or sends ``{"op": "end"}``);
        A request with a ``"seed"`` seeds the machine first, as a cell's seed does.
        ``answer(value)`` sends one value back as data (``--pull``'s encoding, never a
        pickle), ``answer(error=exc)`` an error. The host starts sending only once the cell
        has answered (or sent ``answer(None)``) once."""
        # here, not at start-up: pickle and its kin are not on the ready path
        from . import pulldata

        agent = self._agent
        conn = agent._conn
        if conn is None:
            raise RuntimeError("this cell has no connection to the host to keep")
        waiting, held = select.poll(), bytearray()
        waiting.register(conn, select.POLLIN)

        def readline():
            # Wait in poll() for input, not in a blocking recv(): the host reading this
            # machine's last answer frees its socket's send space, and the kernel's wake-up
            # for that wakes a reader asleep in recv() for nothing, not a poll for input.
            while True:
                end = held.find(b"\n", 0, CHANNEL_LINE)
                if end >= 0 or len(held) >= CHANNEL_LINE:
                    n = end + 1 if end >= 0 else CHANNEL_LINE
                    line = bytes(held[:n])
                    del held[:n]
                    return line
                waiting.poll()
                chunk = conn.recv(65536)
                if not chunk:
                    line = bytes(held)
                    held.clear()
                    return line
                held.extend(chunk)

        def requests():
            while True:
                line = readline()
                if not line or not line.endswith(b"\n"):
                    return
                if line.startswith(STEP_HEAD) and line.endswith(STEP_TAIL):
                    v = line[len(STEP_HEAD):-len(STEP_TAIL)]
                    if v.isdigit() and (v[:1] != b"0" or len(v) == 1):
                        yield {"op": "step", "a": {"$": "int64", "v": int(v)}}
                        continue
                req = P.decode(line)
                if not isinstance(req, dict) or req.get("op") == "end":
                    return
                if req.get("seed") is not None:  # seeds the machine first, as a cell's request does
                    agent.apply_seed(req.pop("seed"))
                yield req

        def warm(value):
            """What ``answer(value)`` does but the send: run once in a fresh branch before its
            first request, so the pages that path writes are its own already (copy-on-write)."""
            P.decode(P.encode({"op": "reset", "r": "{}", "seed": 1}))
            agent.apply_seed(agent.seed)  # the seeding path too (the episode's request seeds it again)
            P.encode({"t": "answer", "value": pulldata._pull(value, False)})
            info = pulldata._pull(value.get("info"), False) if isinstance(value, dict) else None
            return P.encode({"t": "answer", "step": {"o": pulldata._npy(value["obs"]), "r": 1.0, "f": 0, "i": info}})

        def answer(value=None, error=None):
            if error is not None:
                agent.send({"t": "answer", "error": {"ename": type(error).__name__, "evalue": str(error)[:2000],
                                                     "traceback": _frames(error)}})
            else:
                agent.send({"t": "answer", "value": pulldata._pull(value, False)})  # the encoding cells' pulls use

        def step(obs, reward, flags, info, rng=None):
            """A step's answer in its lean form (an array observation as ``.npy``, the rest as
            pulled data; see ``smolbench/gate/channel.py``)."""
            np = sys.modules.get("numpy")
            if rng is None and not flags and type(reward) is float and type(info) is dict and not info \
                    and np is not None and type(obs) is np.ndarray:
                agent.send_line(LEAN_HEAD + pulldata._npy(obs).encode("ascii") + LEAN_TAIL % repr(reward).encode("ascii"))
                return
            fields = {"o": pulldata._npy(obs)} if np is not None and type(obs) is np.ndarray else {"ov": pulldata._pull(obs, False)}
            fields.update(r=reward, f=flags, i=pulldata._pull(info, False))
            if rng is not None:
                fields["g"] = pulldata._data(rng)
            agent.send({"t": "answer", "step": fields})

        answer.warm = warm
        answer.step = step
        return requests(), answer
