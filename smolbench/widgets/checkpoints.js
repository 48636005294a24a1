// smolbench checkpoint panel: the ledger's checkpoints, with Save / Restore / Delete.

const ACK_MS = 800;
const CONFIRM_MS = 5000;

function render({ model, el }) {
  // Marks the live view, so the static copy after it (an output of its own) hides itself.
  const staticId = String(model.get("static_id") || "").replace(/[^0-9a-zA-Z]/g, "");
  if (staticId) el.classList.add(`sbl-${staticId}`);
  let picked = null; // checkpoint name the Restore / Delete buttons act on (this view only)
  let seq = 0;
  let confirm = null; // {name, timer} while Delete waits for its second click
  const pending = new Map(); // request id -> {label, acked, timer}
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

  function say(level, text) {
    msg.className = `sbc-msg sbc-msg-${level}`;
    msg.textContent = text;
  }

  let kernelGone = false;

  function send(action, extra) {
    if (kernelGone) {
      say("error", GONE_TEXT);
      return;
    }
    const id = `${Date.now().toString(36)}-${++seq}`;
    const label = `${action}${extra.name ? ` ${extra.name}` : ""}`;
    const p = { label, acked: false, timer: null };
    pending.set(id, p);
    say("info", `${label}: sent to the kernel…`);
    p.timer = setTimeout(() => {
      if (!p.acked && pending.has(id) && kernelBusy(model))
        say("info", `${label}: queued: the kernel is running a cell and will apply this click when it finishes`);
    }, ACK_MS);
    try {
      model.send({ type: "action", action, id, ...extra });
    } catch (e) {
      pending.delete(id);
      say("error", `${label}: can't reach the kernel (${e}): ${GONE_TEXT}`);
    }
  }

  function draw() {
    const rows = model.get("checkpoints") || [];
    const backend = model.get("backend") || "";
    const more = model.get("more") || "";
    sub.textContent = `${rows.length} saved · ${backend ? `this machine: ${backend}` : "no machine up (`%smol up`)"}` +
      (more ? ` · ${more}` : "");
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
        h("td", "sbc-num", c.size_text || ""), h("td", "", c.backend),
        h("td", "sbc-note", (c.blocked && c.blocked.restore) || (warn ? `warning: ${warn}` : "")));
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
    restoreBtn.title = why ? `Restore is off: ${why}` : `restore ${picked} as a new machine`;
    deleteBtn.disabled = !c;
    deleteBtn.title = c ? `delete checkpoint ${picked} (file and ledger entry; asks first)` : "pick a checkpoint first";
    const confirming = confirm && c && confirm.name === picked;
    deleteBtn.textContent = confirming ? "Confirm delete" : "Delete";
    deleteBtn.classList.toggle("sbc-confirm", Boolean(confirming));
    if (kernelGone) {
      for (const b of [saveBtn, restoreBtn, deleteBtn]) {
        b.disabled = true;
        b.title = `${b.textContent} is off: ${GONE_TEXT}`;
      }
      sub.textContent = `${rows.length} saved · kernel gone`;
    }
  }

  saveBtn.addEventListener("click", () =>
    send("save", { name: nameIn.value.trim(), node: nodeSel.value, force: force.checked }));
  restoreBtn.addEventListener("click", () => picked && send("restore", { name: picked }));
  deleteBtn.addEventListener("click", () => {
    if (!picked) return;
    if (!confirm || confirm.name !== picked) {
      if (confirm) clearTimeout(confirm.timer);
      const name = picked;
      confirm = { name, timer: setTimeout(() => { confirm = null; say("info", `delete ${name}: not confirmed, nothing deleted`); draw(); }, CONFIRM_MS) };
      say("info", `delete checkpoint ${name} (its file and its ledger entry)? Click "Confirm delete" to go ahead.`);
      draw();
      return;
    }
    clearTimeout(confirm.timer);
    confirm = null;
    send("delete", { name: picked });
    draw();
  });

  const onMessage = () => {
    const m = model.get("message") || {};
    say(m.level || "info", m.text || "");
  };
  const onCustom = (content) => {
    if (!content) return;
    const p = pending.get(content.id);
    if (!p) return;
    if (content.type === "ack") {
      p.acked = true;
      say("info", `${p.label}: working…`);
    } else if (content.type === "reply") {
      clearTimeout(p.timer);
      pending.delete(content.id);
    }
  };
  const handlers = [
    ["change:checkpoints", draw], ["change:live_nodes", draw], ["change:active", draw],
    ["change:backend", draw], ["change:more", draw], ["change:message", onMessage], ["msg:custom", onCustom],
  ];
  for (const [ev, fn] of handlers) model.on(ev, fn);
  const unwatch = watchKernel(model, () => {
    kernelGone = true;
    if (confirm) clearTimeout(confirm.timer);
    confirm = null;
    for (const p of pending.values()) clearTimeout(p.timer);
    pending.clear();
    say("error", GONE_TEXT);
    draw();
  });
  draw();
  onMessage();
  return () => {
    unwatch();
    if (confirm) clearTimeout(confirm.timer);
    for (const p of pending.values()) clearTimeout(p.timer);
    for (const [ev, fn] of handlers) model.off(ev, fn);
  };
}

export default { render };
