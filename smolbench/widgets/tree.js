// smolbench fork tree: an indented, collapsible list of nodes with status colours, rewards,
// the best path highlighted, and actions on the selected node. No dependencies, no CDN.
// Only characters every Debian font set has (DejaVu): no emoji.

// A node with more children than FAN shows FAN_SHOW of them (running and errored ones always,
// then the best path, the active one, the selected one, the highest rewards) and a "show all"
// row that says so (static.py's rule too).
const FAN = 12;
const FAN_SHOW = 8;
const NEVER_FOLDED = new Set(["running", "starting", "error", "timeout"]);
const FOLD_RULE = "the lowest rewards are folded; errored and running branches are always shown";
const ACK_MS = 800; // no acknowledgement by then: the kernel is busy (queued) or unreachable
const LOST_MS = 15000;
const CONFIRM_MS = 5000;
const MESSAGES = 3; // lines of messages a view keeps

const ACTIONS = [
  ["use", "Use", "make this node the active machine"],
  ["fork", "Fork", "run this fork's cell in N new branches of this node"],
  ["checkpoint", "Checkpoint", "save this node's machine as a checkpoint"],
  ["delete", "Delete", "delete this node's machine and everything below it (asks first)"],
];
const LABELS = { use: "Use", fork: "Fork ×N", checkpoint: "Checkpoint", delete: "Delete" };

function fmt(x, digits = 4) {
  if (x === null || x === undefined) return "";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  return Number(x.toPrecision(digits)).toString();
}

// Where a cluster machine runs (text only: a node's host name is data): "3f2a9c1b (sandbox on host)".
function whereText(n) {
  const about = [n.where_kind, n.where_host].filter((x) => x).join(" on ");
  const moved = n.moved_from ? `moved from ${String(n.moved_from).slice(0, 8)}` : "";
  const tail = [about, moved].filter((x) => x).join("; ");
  return String(n.where).slice(0, 8) + (tail ? ` (${tail})` : "");
}

function render({ model, el }) {
  // Marks the live view, so the static copy after it (an output of its own) hides itself.
  const staticId = String(model.get("static_id") || "").replace(/[^0-9a-zA-Z]/g, "");
  if (staticId) el.classList.add(`sbl-${staticId}`);
  const view = {
    collapsed: new Set(),
    fanOpen: new Set(), // parents whose large fan shows every child
    sortBy: "id",
    pending: new Map(), // request id -> {label, acked, timers}
    seq: 0,
    confirm: null, // {node, timer} while Delete waits for its second click
    kernelGone: false, // the kernel died, restarted or was shut down: nothing here is live
    recent: [], // the last MESSAGES messages: {key, level, text}
  };
  const root = h("div", "sbt");
  el.appendChild(root);

  const head = h("div", "sbt-head");
  const title = h("span", "sbt-title");
  const liveBadge = h("span", "sbt-live");
  const summary = h("span", "sbt-summary");
  const tools = h("span", "sbt-tools");
  const scopeBtn = h("button", "sbt-link sbt-scope");
  const sortBtn = h("button", "sbt-link", "sort: id");
  sortBtn.title = "order siblings by id or by reward";
  const expandBtn = h("button", "sbt-link", "expand all");
  const collapseBtn = h("button", "sbt-link", "collapse all");
  tools.append(scopeBtn, sortBtn, expandBtn, collapseBtn);
  head.append(title, liveBadge, summary, tools);

  const info = h("div", "sbt-info");
  const list = h("div", "sbt-list");
  list.setAttribute("role", "tree");

  const detail = h("div", "sbt-detail");
  const bar = h("div", "sbt-actions");
  const buttons = {};
  const nInput = h("input", "sbt-n");
  nInput.type = "number";
  nInput.min = "1";
  nInput.max = "256";
  nInput.value = "4";
  nInput.title = "how many branches Fork makes";
  const seedInput = h("input", "sbt-seed-base");
  seedInput.type = "number";
  seedInput.title = "first seed of the new branches (empty: after the highest seed used in this session, so seeds never repeat)";
  for (const [action, label, tip] of ACTIONS) {
    const wrap = h("span", "sbt-btnwrap");
    const b = h("button", `sbt-btn sbt-btn-${action}`, label);
    b.dataset.action = action;
    b.dataset.tip = tip;
    b.addEventListener("click", () => act(action));
    wrap.appendChild(b);
    if (action === "fork") {
      wrap.append(h("span", "sbt-times", "×"), nInput, h("span", "sbt-times", "seeds from"), seedInput);
    }
    buttons[action] = { button: b, wrap };
    bar.appendChild(wrap);
  }
  const msg = h("div", "sbt-msg");
  msg.setAttribute("role", "status");
  const jobs = h("div", "sbt-jobs");
  const logBox = h("details", "sbt-log");
  const logSummary = h("summary", "", "log");
  const logPre = h("pre", "sbt-log-text");
  logBox.append(logSummary, logPre);
  root.append(head, info, list, detail, bar, msg, jobs, logBox);

  function nodesById() {
    const byId = new Map();
    for (const n of model.get("nodes") || []) byId.set(n.id, n);
    return byId;
  }

  // The last few messages, one line per click (keyed by its request), so the answer to one
  // click (a Use) is not overwritten by a later one (a background Fork finishing).
  function showMessage(m, key = "local") {
    if (!m || !m.text) return;
    view.recent = view.recent.filter((r) => r.key !== key);
    view.recent.push({ key, level: m.level || "info", text: m.text });
    view.recent = view.recent.slice(-MESSAGES);
    const newest = view.recent[view.recent.length - 1];
    msg.className = `sbt-msg sbt-msg-${newest.level}`;
    msg.replaceChildren(...view.recent.map((r) => h("div", `sbt-msg-line sbt-msg-${r.level}`, r.text)));
  }

  function messageOf(key) {
    const r = view.recent.find((x) => x.key === key);
    return r ? r.text : "";
  }

  function act(action) {
    const node = model.get("selected");
    if (!node) return;
    if (view.kernelGone) {
      showMessage({ level: "error", text: GONE_TEXT });
      return;
    }
    if (action === "delete") {
      if (!view.confirm || view.confirm.node !== node) {
        clearTimeout(view.confirm && view.confirm.timer);
        const below = (model.get("nodes") || []).filter((n) => n.alive && n.id.startsWith(`${node}.`)).length;
        view.confirm = {
          node,
          timer: setTimeout(() => {
            view.confirm = null;
            showMessage({ level: "info", text: `delete ${node}: not confirmed, nothing deleted` });
            drawActions();
          }, CONFIRM_MS),
        };
        const extra = below ? ` and ${below} live machine${below === 1 ? "" : "s"} below it` : "";
        showMessage({ level: "info", text: `delete ${node}${extra}? Click "Confirm delete" to go ahead.` });
        drawActions();
        return;
      }
      clearTimeout(view.confirm.timer);
      view.confirm = null;
    }
    const id = `${Date.now().toString(36)}-${++view.seq}`;
    const content = { type: "action", action, node, id };
    const label = `${LABELS[action]} ${node}`;
    if (action === "fork") {
      content.n = parseInt(nInput.value, 10);
      if (seedInput.value !== "") content.seed_base = parseInt(seedInput.value, 10);
    }
    const p = { label, acked: false, timers: [] };
    view.pending.set(id, p);
    view.recent = view.recent.filter((r) => r.key !== "local"); // e.g. the delete question
    showMessage({ level: "info", text: `${label}: sent to the kernel…` }, id);
    p.timers.push(
      setTimeout(() => {
        if (p.acked || !view.pending.has(id)) return;
        if (kernelBusy(model)) {
          showMessage(
            {
              level: "info",
              text: `${label}: queued: the kernel is running a cell and will apply this click when it finishes`,
            },
            id,
          );
        }
      }, ACK_MS),
      setTimeout(() => {
        if (p.acked || !view.pending.has(id) || kernelBusy(model)) return;
        showMessage(
          {
            level: "error",
            text: `${label}: no answer from the kernel after ${LOST_MS / 1000} s: is it running? (Kernel menu: restart, then re-run the cells)`,
          },
          id,
        );
      }, LOST_MS),
    );
    try {
      model.send(content);
    } catch (e) {
      view.pending.delete(id);
      showMessage({ level: "error", text: `${label}: can't reach the kernel (${e}): ${GONE_TEXT}` }, id);
    }
    drawActions();
  }

  function select(id) {
    // Kept in this frontend only: each output has its own selection, and selecting never
    // sends the kernel a message (which would flip its status while a cell runs).
    model.set("selected", id);
    seedInput.value = "";
    drawAll();
  }

  function drawRows() {
    const nodes = model.get("nodes") || [];
    const byId = new Map(nodes.map((n) => [n.id, n]));
    const kids = new Map();
    const roots = [];
    for (const n of nodes) {
      if (n.parent && byId.has(n.parent)) {
        if (!kids.has(n.parent)) kids.set(n.parent, []);
        kids.get(n.parent).push(n);
      } else roots.push(n);
    }
    const best = new Set(model.get("best_path") || []);
    const bestId = (model.get("best_path") || []).slice(-1)[0];
    const active = model.get("active");
    const selected = model.get("selected");

    const rewards = nodes.map((n) => n.reward).filter((r) => typeof r === "number");
    const lo = Math.min(0, ...rewards);
    const hi = Math.max(...rewards, lo + 1e-12);

    const order = (arr) => {
      if (view.sortBy !== "reward") return arr;
      return [...arr].sort((a, b) => (b.reward ?? -Infinity) - (a.reward ?? -Infinity));
    };

    const frag = document.createDocumentFragment();
    const activePath = new Set();
    for (let cur = byId.get(active); cur; cur = byId.get(cur.parent)) activePath.add(cur.id);

    const visibleKids = (n, children) => {
      if (children.length <= FAN || view.fanOpen.has(n.id)) return children;
      const keep = new Set(
        children
          .filter((c) => NEVER_FOLDED.has(c.status) || best.has(c.id) || activePath.has(c.id) || c.id === selected)
          .map((c) => c.id),
      );
      const byReward = children.filter((c) => typeof c.reward === "number").sort((a, b) => b.reward - a.reward);
      for (const c of [...byReward, ...children]) {
        if (keep.size >= FAN_SHOW) break;
        keep.add(c.id);
      }
      return children.filter((c) => keep.has(c.id));
    };
    const fanRow = (n, depth, text, open) => {
      const more = h("div", "sbt-more", text);
      more.style.setProperty("--depth", depth + 1);
      more.addEventListener("click", () => {
        if (open) view.fanOpen.add(n.id);
        else view.fanOpen.delete(n.id);
        drawRows();
      });
      return more;
    };

    const walk = (n, depth) => {
      const children = order(kids.get(n.id) || []);
      const row = h("div", "sbt-row");
      row.dataset.id = n.id;
      row.dataset.status = n.status;
      row.setAttribute("role", "treeitem");
      row.classList.add(`sbt-s-${n.status}`);
      if (!n.alive) row.classList.add("sbt-dead");
      if (!n.mine && model.get("scope") === "fork") row.classList.add("sbt-context");
      if (best.has(n.id)) row.classList.add("sbt-best");
      if (n.id === bestId) row.classList.add("sbt-bestnode");
      if (n.id === active) row.classList.add("sbt-active");
      if (n.id === selected) row.classList.add("sbt-selected");
      row.style.setProperty("--depth", depth);

      const tog = h("span", "sbt-tog");
      if (children.length) {
        const closed = view.collapsed.has(n.id);
        tog.textContent = closed ? "▸" : "▾";
        tog.title = closed ? `show ${children.length} children` : "hide children";
        tog.addEventListener("click", (e) => {
          e.stopPropagation();
          if (view.collapsed.has(n.id)) view.collapsed.delete(n.id);
          else view.collapsed.add(n.id);
          drawRows();
        });
      }
      const dot = h("span", "sbt-dot");
      dot.title = n.alive ? `${n.status} · machine alive` : `${n.status} · machine deleted`;
      const id = h("span", "sbt-id", n.id);
      const seed = h("span", "sbt-seed", n.seed === null || n.seed === undefined ? "" : `seed ${n.seed}`);
      const status = h("span", "sbt-status", n.status);
      const reward = h("span", "sbt-reward", fmt(n.reward));
      const barCell = h("span", "sbt-bar");
      if (typeof n.reward === "number") {
        const fill = h("span", "sbt-fill");
        fill.style.width = `${Math.max(2, (100 * (n.reward - lo)) / (hi - lo))}%`;
        barCell.appendChild(fill);
      }
      const wall = h("span", "sbt-wall", n.wall === null || n.wall === undefined ? "" : `${fmt(n.wall, 3)} s`);
      const badges = h("span", "sbt-badges");
      if (n.id === active) badges.appendChild(h("span", "sbt-badge sbt-b-active", "active"));
      if (n.id === bestId) badges.appendChild(h("span", "sbt-badge sbt-b-best", "★ best"));
      if (n.kept && n.alive) badges.appendChild(h("span", "sbt-badge sbt-b-kept", "kept"));
      if (n.alive && !n.kept && n.parent) badges.appendChild(h("span", "sbt-badge sbt-b-alive", "alive"));
      if (n.checkpoint) badges.appendChild(h("span", "sbt-badge sbt-b-ckpt", `ckpt ${n.checkpoint}`));
      if (n.where) {
        const at = h("span", `sbt-badge sbt-b-node${n.moved_from ? " sbt-b-moved" : ""}`, `@${String(n.where).slice(0, 8)}`);
        at.title = `Ray node ${n.where}${n.where_kind ? ` · ${n.where_kind} backend` : ""}${n.where_host ? ` · host ${n.where_host}` : ""}` +
          (n.moved_from ? ` · rebuilt here after node ${n.moved_from} was lost` : "");
        badges.appendChild(at);
      }
      if (children.length && view.collapsed.has(n.id))
        badges.appendChild(h("span", "sbt-badge sbt-b-more", `+${children.length}`));
      const lead = h("span", "sbt-lead");
      lead.append(tog, dot, id);
      row.append(lead, seed, status, reward, barCell, wall, badges);
      const tip = [n.id, n.status];
      if (n.where) tip.push(`node ${whereText(n)}`);
      if (n.error) tip.push(n.error);
      const metrics = Object.entries(n.metrics || {});
      if (metrics.length) tip.push(metrics.map(([k, v]) => `${k}=${fmt(v)}`).join(", "));
      row.title = tip.join(" · ");
      row.addEventListener("click", () => select(n.id));
      frag.appendChild(row);
      if (view.collapsed.has(n.id)) return;
      const shown = visibleKids(n, children);
      for (const c of shown) walk(c, depth + 1);
      if (shown.length < children.length) {
        const left = children.length - shown.length;
        frag.appendChild(fanRow(n, depth, `… ${left} more branches of ${n.id} (${FOLD_RULE}): show all`, true));
      } else if (children.length > FAN) {
        frag.appendChild(fanRow(n, depth, `show only the top ${FAN_SHOW} branches of ${n.id}`, false));
      }
    };
    for (const r of order(roots)) walk(r, 0);
    list.replaceChildren(frag);
    if (!nodes.length) list.appendChild(h("div", "sbt-empty", "no machines yet: `%smol up`"));

    const counts = {};
    for (const n of nodes) counts[n.status] = (counts[n.status] || 0) + 1;
    const bits = [`${nodes.length} node${nodes.length === 1 ? "" : "s"}`];
    for (const [s, c] of Object.entries(counts).sort()) bits.push(`${c} ${s}`);
    if (bestId && byId.has(bestId)) bits.push(`best ${fmt(byId.get(bestId).reward)} on ${bestId}`);
    summary.textContent = bits.join(" · ");
  }

  function drawDetail() {
    const byId = nodesById();
    const id = model.get("selected");
    const n = id ? byId.get(id) : null;
    detail.replaceChildren();
    if (!n) {
      detail.appendChild(h("span", "sbt-hint", "click a node to act on it"));
      return;
    }
    detail.appendChild(h("b", "sbt-d-id", n.id));
    const parts = [];
    if (n.seed !== null && n.seed !== undefined) parts.push(`seed ${n.seed}`);
    parts.push(n.status);
    if (typeof n.reward === "number") parts.push(`reward ${fmt(n.reward, 6)}`);
    if (n.wall !== null && n.wall !== undefined) parts.push(`${fmt(n.wall, 3)} s`);
    parts.push(n.alive ? (n.kept ? "alive (kept)" : "alive") : "deleted");
    if (n.checkpoint) parts.push(`checkpoint ${n.checkpoint}`);
    if (n.where) parts.push(`node ${whereText(n)}`);
    const metrics = Object.entries(n.metrics || {});
    if (metrics.length) parts.push(metrics.map(([k, v]) => `${k}=${fmt(v)}`).join(", "));
    detail.appendChild(h("span", "sbt-d-text", ` · ${parts.join(" · ")}`));
    if (n.error) detail.appendChild(h("div", "sbt-d-error", n.error));
  }

  function drawActions() {
    const byId = nodesById();
    const id = model.get("selected");
    const n = id ? byId.get(id) : null;
    const waiting = [...view.pending.values()].map((p) => p.label);
    for (const [action] of ACTIONS) {
      const { button, wrap } = buttons[action];
      let why = "";
      if (view.kernelGone) why = GONE_TEXT;
      else if (!n) why = "click a node first";
      else if (n.blocked && n.blocked[action]) why = n.blocked[action];
      else if (waiting.includes(`${LABELS[action]} ${id}`)) why = "waiting for the kernel";
      button.disabled = Boolean(why);
      const tip = why ? `${LABELS[action]} is off: ${why}` : button.dataset.tip;
      button.title = tip;
      wrap.title = tip; // a disabled button shows no tooltip of its own in some browsers
      if (action === "fork") {
        nInput.disabled = Boolean(why);
        seedInput.disabled = Boolean(why);
        seedInput.placeholder = n && n.next_seed !== undefined ? `auto: ${n.next_seed}` : "auto";
      }
      if (action === "delete") {
        const confirming = view.confirm && view.confirm.node === id;
        button.textContent = confirming ? "Confirm delete" : "Delete";
        button.classList.toggle("sbt-confirm", Boolean(confirming));
      }
    }
  }

  function drawJobs() {
    const j = model.get("jobs") || [];
    jobs.textContent = j.length ? `running: ${j.join(", ")}` : "";
  }

  function drawLog() {
    const text = model.get("log") || "";
    logBox.style.display = text ? "" : "none";
    const lines = text ? text.split("\n").length - 1 : 0;
    logSummary.textContent = `log of forks started here (${lines} line${lines === 1 ? "" : "s"})`;
    logPre.textContent = text;
  }

  function drawHead() {
    title.textContent = model.get("title") || "fork tree";
    const live = model.get("live") && !view.kernelGone;
    liveBadge.textContent = view.kernelGone ? "kernel gone" : live ? "live" : "final";
    liveBadge.className = `sbt-live ${live ? "sbt-live-on" : "sbt-live-off"}`;
    liveBadge.title = view.kernelGone
      ? GONE_TEXT
      : live
        ? "updates as the machines change (also after this cell finished)"
        : "the machines are gone (`%smol down`): this is the last state";
    const scope = model.get("scope");
    scopeBtn.style.display = model.get("title") === "fork tree" && scope === "session" ? "none" : "";
    scopeBtn.textContent = scope === "fork" ? "show whole session" : "show this fork only";
    scopeBtn.title = scope === "fork" ? "every node of this session" : "the path to this fork and its branches";
    info.textContent = view.kernelGone ? `${GONE_TEXT} · last seen: ${model.get("info") || ""}` : model.get("info") || "";
    scopeBtn.disabled = view.kernelGone;
  }

  function drawAll() {
    drawHead();
    sortBtn.textContent = `sort: ${view.sortBy}`;
    drawRows();
    drawDetail();
    drawActions();
  }

  scopeBtn.addEventListener("click", () => {
    const next = model.get("scope") === "fork" ? "session" : "fork";
    try {
      model.send({ type: "scope", scope: next });
    } catch (e) {
      showMessage({ level: "error", text: `can't reach the kernel (${e})` });
    }
  });
  sortBtn.addEventListener("click", () => {
    view.sortBy = view.sortBy === "id" ? "reward" : "id";
    drawAll();
  });
  expandBtn.title = "show every node, large fans too";
  expandBtn.addEventListener("click", () => {
    view.collapsed.clear();
    for (const n of model.get("nodes") || []) if (n.parent) view.fanOpen.add(n.parent);
    drawRows();
  });
  collapseBtn.title = "show only the roots";
  collapseBtn.addEventListener("click", () => {
    view.fanOpen.clear();
    for (const n of model.get("nodes") || []) if (n.parent) view.collapsed.add(n.parent);
    drawRows();
  });

  const onCustom = (content) => {
    if (!content) return;
    const p = view.pending.get(content.id);
    if (content.type === "ack") {
      if (p) {
        p.acked = true;
        const now = messageOf(content.id);
        if (now.includes("queued") || now.includes("sent to the kernel"))
          showMessage({ level: "info", text: `${p.label}: working…` }, content.id);
      }
      return;
    }
    if (content.type !== "reply") return;
    if (p) for (const t of p.timers) clearTimeout(t);
    view.pending.delete(content.id);
    drawActions();
  };
  const onMessage = () => {
    const m = model.get("message");
    if (m && m.text) showMessage(m, m.request || "kernel");
  };
  const handlers = [
    ["change:nodes", drawAll],
    ["change:active", drawAll],
    ["change:best_path", drawRows],
    ["change:selected", drawAll],
    ["change:info", drawHead],
    ["change:title", drawHead],
    ["change:live", drawHead],
    ["change:scope", drawAll],
    ["change:can_fork", drawActions],
    ["change:jobs", drawJobs],
    ["change:log", drawLog],
    ["change:message", onMessage],
    ["msg:custom", onCustom],
  ];
  for (const [ev, fn] of handlers) model.on(ev, fn);
  const unwatch = watchKernel(model, () => {
    view.kernelGone = true;
    for (const p of view.pending.values()) for (const t of p.timers) clearTimeout(t);
    view.pending.clear();
    clearTimeout(view.confirm && view.confirm.timer);
    view.confirm = null;
    root.classList.add("sbt-gone");
    showMessage({ level: "error", text: GONE_TEXT });
    drawAll();
    jobs.textContent = "";
  });
  drawAll();
  drawJobs();
  drawLog();
  onMessage();
  return () => {
    unwatch();
    clearTimeout(view.confirm && view.confirm.timer);
    for (const p of view.pending.values()) for (const t of p.timers) clearTimeout(t);
    for (const [ev, fn] of handlers) model.off(ev, fn);
  };
}

export default { render };
