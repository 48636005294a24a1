// smolbench checkpoint panel: the ledger's checkpoints, with Save / Restore / Delete.

function h(tag, cls, text) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  if (text !== undefined && text !== null) el.textContent = String(text);
  return el;
}

function size(bytes) {
  if (typeof bytes !== "number") return "";
  if (bytes < 1e3) return `${bytes} B`;
  if (bytes < 1e6) return `${(bytes / 1e3).toFixed(1)} kB`;
  if (bytes < 1e9) return `${(bytes / 1e6).toFixed(1)} MB`;
  return `${(bytes / 1e9).toFixed(2)} GB`;
}

function render({ model, el }) {
  let picked = null; // checkpoint name the Restore / Delete buttons act on
  let seq = 0;
  const root = h("div", "sbc");
  el.appendChild(root);
  const head = h("div", "sbc-head");
  head.append(h("span", "sbc-title", "checkpoints"));
  const sub = h("span", "sbc-sub");
  head.appendChild(sub);

  const table = h("table", "sbc-table");
  const thead = h("thead");
  const tr = h("tr");
  for (const c of ["name", "node", "created", "size", "backend", ""]) tr.appendChild(h("th", "", c));
  thead.appendChild(tr);
  const tbody = h("tbody");
  table.append(thead, tbody);

  const saveBar = h("div", "sbc-bar");
  const nameIn = h("input", "sbc-name");
  nameIn.placeholder = "name (optional)";
  nameIn.title = "checkpoint name: letters, digits, . _ -";
  const nodeSel = h("select", "sbc-node");
  nodeSel.title = "the node to save";
  const forceLbl = h("label", "sbc-force");
  const force = h("input");
  force.type = "checkbox";
  forceLbl.append(force, document.createTextNode(" replace"));
  forceLbl.title = "replace a checkpoint with the same name (--force)";
  const saveBtn = h("button", "sbc-btn", "Save");
  const restoreBtn = h("button", "sbc-btn", "Restore");
  const deleteBtn = h("button", "sbc-btn sbc-danger", "Delete");
  saveBar.append(nameIn, nodeSel, forceLbl, saveBtn, h("span", "sbc-sep"), restoreBtn, deleteBtn);
  const msg = h("div", "sbc-msg");
  root.append(head, table, saveBar, msg);

  function send(action, extra) {
    const id = `${Date.now().toString(36)}-${++seq}`;
    msg.className = "sbc-msg sbc-msg-info";
    msg.textContent = `${action}: sent to the kernel…`;
    model.send({ type: "action", action, id, ...extra });
  }

  function draw() {
    const rows = model.get("checkpoints") || [];
    const backend = model.get("backend") || "";
    sub.textContent = `${rows.length} saved · this machine: ${backend}`;
    if (picked && !rows.some((r) => r.name === picked)) picked = null;
    tbody.replaceChildren();
    if (!rows.length) {
      const r = h("tr");
      const td = h("td", "sbc-empty", "no checkpoints yet: name one and press Save");
      td.colSpan = 6;
      r.appendChild(td);
      tbody.appendChild(r);
    }
    for (const c of rows) {
      const r = h("tr", "sbc-row");
      r.dataset.name = c.name;
      if (c.name === picked) r.classList.add("sbc-picked");
      if (c.blocked && c.blocked.restore) r.classList.add("sbc-blocked");
      const warn = (c.warnings || []).join("; ");
      r.append(h("td", "sbc-n", c.name), h("td", "", c.node), h("td", "", c.created_text),
        h("td", "sbc-num", size(c.size)), h("td", "", c.backend),
        h("td", "sbc-note", (c.blocked && c.blocked.restore) || (warn ? `⚠ ${warn}` : "")));
      r.title = [c.blocked && c.blocked.restore, warn].filter(Boolean).join(" · ");
      r.addEventListener("click", () => { picked = c.name; draw(); });
      tbody.appendChild(r);
    }
    const live = model.get("live_nodes") || [];
    const active = model.get("active");
    const keep = nodeSel.value;
    nodeSel.replaceChildren();
    for (const id of live) {
      const o = h("option", "", id === active ? `${id} (active)` : id);
      o.value = id;
      nodeSel.appendChild(o);
    }
    nodeSel.value = live.includes(keep) ? keep : (active || live[0] || "");
    saveBtn.disabled = !live.length;
    saveBtn.title = live.length ? "save the chosen node's machine" : "no live machine to save: `%smol up`";
    const c = rows.find((x) => x.name === picked);
    const why = !c ? "pick a checkpoint first" : (c.blocked && c.blocked.restore) || "";
    restoreBtn.disabled = Boolean(why);
    restoreBtn.title = why ? `disabled because ${why}` : `restore ${picked} as a new machine`;
    deleteBtn.disabled = !c;
    deleteBtn.title = c ? `delete checkpoint ${picked} (file and ledger entry)` : "pick a checkpoint first";
  }

  saveBtn.addEventListener("click", () =>
    send("save", { name: nameIn.value.trim(), node: nodeSel.value, force: force.checked }));
  restoreBtn.addEventListener("click", () => picked && send("restore", { name: picked }));
  deleteBtn.addEventListener("click", () => picked && send("delete", { name: picked }));

  const onMessage = () => {
    const m = model.get("message") || {};
    msg.className = `sbc-msg sbc-msg-${m.level || "info"}`;
    msg.textContent = m.text || "";
  };
  const onBusy = () => {
    const b = model.get("busy");
    if (b) { msg.className = "sbc-msg sbc-msg-info"; msg.textContent = `⏳ ${b}`; } else onMessage();
  };
  const handlers = [
    ["change:checkpoints", draw], ["change:live_nodes", draw], ["change:active", draw],
    ["change:message", onMessage], ["change:busy", onBusy],
  ];
  for (const [ev, fn] of handlers) model.on(ev, fn);
  try {
    model.send({ type: "hello" }); // tells the kernel whether clicks arrive over a subshell
  } catch (e) {
    // no kernel (a saved notebook): the view still shows the saved state
  }
  draw();
  onMessage();
  return () => { for (const [ev, fn] of handlers) model.off(ev, fn); };
}

export default { render };
