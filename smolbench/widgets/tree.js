// smolbench fork tree: an indented, collapsible list of nodes with status colours, rewards,
// the best path highlighted, and actions on the selected node. No dependencies, no CDN.

// A node with more children than FAN shows FAN_SHOW of them (the best path, the active one,
// the selected one, then the highest rewards) and a "show all" row for the rest.
const FAN = 12;
const FAN_SHOW = 8;

const ACTIONS = [
  ["use", "Use", "make this node the active machine"],
  ["fork", "Fork", "run the last fork's cell in N new branches of this node"],
  ["checkpoint", "Checkpoint", "save this node's machine as a checkpoint"],
  ["delete", "Delete", "delete this node's machine and everything below it"],
];

function h(tag, cls, text) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  if (text !== undefined && text !== null) el.textContent = String(text);
  return el;
}

function fmt(x, digits = 4) {
  if (x === null || x === undefined) return "";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  return Number(x.toPrecision(digits)).toString();
}

function render({ model, el }) {
  const view = {
    collapsed: new Set(),
    fanOpen: new Set(), // parents whose large fan shows every child
    scrolled: false,
    sortBy: "id",
    pending: new Map(), // request id -> label, until the kernel replies
    seq: 0,
    busyTimer: null,
  };
  const root = h("div", "sbt");
  el.appendChild(root);

  const head = h("div", "sbt-head");
  const title = h("span", "sbt-title", "fork tree");
  const summary = h("span", "sbt-summary");
  const tools = h("span", "sbt-tools");
  const sortBtn = h("button", "sbt-link", "sort: id");
  sortBtn.title = "order siblings by id or by reward";
  const expandBtn = h("button", "sbt-link", "expand all");
  const collapseBtn = h("button", "sbt-link", "collapse all");
  tools.append(sortBtn, expandBtn, collapseBtn);
  head.append(title, summary, tools);

  const info = h("div", "sbt-info");
  const busy = h("div", "sbt-busy");
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
  for (const [action, label, tip] of ACTIONS) {
    const wrap = h("span", "sbt-btnwrap");
    const b = h("button", `sbt-btn sbt-btn-${action}`, label);
    b.dataset.action = action;
    b.dataset.tip = tip;
    b.addEventListener("click", () => act(action));
    wrap.appendChild(b);
    if (action === "fork") {
      const x = h("span", "sbt-times", "×");
      wrap.append(x, nInput);
    }
    buttons[action] = { button: b, wrap };
    bar.appendChild(wrap);
  }
  const msg = h("div", "sbt-msg");
  const jobs = h("div", "sbt-jobs");
  root.append(head, info, busy, list, detail, bar, msg, jobs);

  function nodesById() {
    const byId = new Map();
    for (const n of model.get("nodes") || []) byId.set(n.id, n);
    return byId;
  }

  function act(action) {
    const node = model.get("selected");
    if (!node) return;
    const id = `${Date.now().toString(36)}-${++view.seq}`;
    const content = { type: "action", action, node, id };
    if (action === "fork") content.n = parseInt(nInput.value, 10);
    view.pending.set(id, `${action} ${node}`);
    showMessage({ level: "info", text: `${action} ${node}: sent to the kernel…` });
    model.send(content);
    drawActions();
  }

  function showMessage(m) {
    msg.className = `sbt-msg sbt-msg-${(m && m.level) || "info"}`;
    msg.textContent = (m && m.text) || "";
  }

  function select(id) {
    model.set("selected", id);
    model.save_changes();
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

    // reward scale for the bars: over every rewarded node
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
      const keep = new Set(children.filter((c) => best.has(c.id) || activePath.has(c.id) || c.id === selected).map((c) => c.id));
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

    // depth in the drawn tree (episode ids like ep1.0 are roots despite their dot)
    const walk = (n, depth) => {
      const children = order(kids.get(n.id) || []);
      const row = h("div", "sbt-row");
      row.dataset.id = n.id;
      row.dataset.status = n.status;
      row.setAttribute("role", "treeitem");
      row.classList.add(`sbt-s-${n.status}`);
      if (!n.alive) row.classList.add("sbt-dead");
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
      if (n.kept) badges.appendChild(h("span", "sbt-badge sbt-b-kept", "kept"));
      if (n.alive && !n.kept && n.parent) badges.appendChild(h("span", "sbt-badge sbt-b-alive", "alive"));
      if (n.checkpoint) badges.appendChild(h("span", "sbt-badge sbt-b-ckpt", `⛁ ${n.checkpoint}`));
      if (children.length && view.collapsed.has(n.id))
        badges.appendChild(h("span", "sbt-badge sbt-b-more", `+${children.length}`));
      const lead = h("span", "sbt-lead");
      lead.append(tog, dot, id);
      row.append(lead, seed, status, reward, barCell, wall, badges);
      const tip = [n.id, n.status];
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
        frag.appendChild(fanRow(n, depth, `… ${left} more branches of ${n.id}: show all`, true));
      } else if (children.length > FAN) {
        frag.appendChild(fanRow(n, depth, `show only the top ${FAN_SHOW} branches of ${n.id}`, false));
      }
    };
    for (const r of order(roots)) walk(r, 0);
    list.replaceChildren(frag);
    if (!nodes.length) list.appendChild(h("div", "sbt-empty", "no machines yet: `%smol up`"));
    if (!view.scrolled && nodes.length) {
      // first draw: bring the active node into view (inside the list, not the page)
      view.scrolled = true;
      const row = list.querySelector(".sbt-active");
      if (row && row.offsetTop > list.clientHeight) list.scrollTop = row.offsetTop - list.clientHeight / 3;
    }

    // header summary
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
    const metrics = Object.entries(n.metrics || {});
    if (metrics.length) parts.push(metrics.map(([k, v]) => `${k}=${fmt(v)}`).join(", "));
    detail.appendChild(h("span", "sbt-d-text", ` · ${parts.join(" · ")}`));
    if (n.error) detail.appendChild(h("div", "sbt-d-error", n.error));
  }

  function drawActions() {
    const byId = nodesById();
    const id = model.get("selected");
    const n = id ? byId.get(id) : null;
    const waiting = [...view.pending.values()];
    for (const [action] of ACTIONS) {
      const { button, wrap } = buttons[action];
      let why = "";
      if (!n) why = "click a node first";
      else if (n.blocked && n.blocked[action]) why = n.blocked[action];
      else if (waiting.includes(`${action} ${id}`)) why = "waiting for the kernel";
      button.disabled = Boolean(why);
      const tip = why ? `${button.dataset.tip}: disabled because ${why}` : button.dataset.tip;
      button.title = tip;
      wrap.title = tip; // a disabled button shows no tooltip of its own in some browsers
      if (action === "fork") nInput.disabled = Boolean(why);
    }
  }

  function drawBusy() {
    const text = model.get("busy");
    clearTimeout(view.busyTimer);
    if (!text) {
      busy.textContent = "";
      busy.classList.remove("sbt-on");
      return;
    }
    // only for cells that take a while: no flicker on quick ones
    view.busyTimer = setTimeout(() => {
      busy.textContent = `⏳ ${text}`;
      busy.classList.add("sbt-on");
    }, 400);
  }

  function drawJobs() {
    const j = model.get("jobs") || [];
    jobs.textContent = j.length ? `running: ${j.join(", ")}` : "";
  }

  function drawAll() {
    info.textContent = model.get("info") || "";
    sortBtn.textContent = `sort: ${view.sortBy}`;
    drawRows();
    drawDetail();
    drawActions();
  }

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
    if (!content || content.type !== "reply") return;
    view.pending.delete(content.id);
    drawActions();
  };
  const onMessage = () => showMessage(model.get("message"));
  const handlers = [
    ["change:nodes", drawAll],
    ["change:active", drawAll],
    ["change:best_path", drawRows],
    ["change:selected", drawAll],
    ["change:info", drawAll],
    ["change:can_fork", drawActions],
    ["change:busy", drawBusy],
    ["change:jobs", drawJobs],
    ["change:message", onMessage],
    ["msg:custom", onCustom],
  ];
  for (const [ev, fn] of handlers) model.on(ev, fn);
  try {
    model.send({ type: "hello" }); // tells the kernel whether clicks arrive over a subshell
  } catch (e) {
    // no kernel (a saved notebook): the view still shows the saved state
  }
  drawAll();
  drawBusy();
  drawJobs();
  onMessage();
  return () => {
    clearTimeout(view.busyTimer);
    for (const [ev, fn] of handlers) model.off(ev, fn);
  };
}

export default { render };
