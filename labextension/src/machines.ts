/**
 * The Machines section: one group per kernel (its notebook, kernel and backend on two
 * wrapped lines), one two-line row per machine (name, state; uptime, memory, Delete or Kill;
 * a third line on a cluster: its Ray node, that node's backend and host),
 * and the words for what changed between two snapshots (the active machine moved, a kernel
 * died) and for what a Delete takes with it.
 */
import { deleteIcon } from '@jupyterlab/ui-components';

import { IKernelGroup, IMachine, IMachines } from './api';
import { basename, button, duration, el, memory } from './format';

const TAIL = 10; // characters of a name that always stay visible (its distinguishing end)
const SKIPPED_SHOWN = 3; // registry files not read, said one line each (the rest counted)

export type DeleteMachine = (group: IKernelGroup, m: IMachine, orphan: boolean) => void;

/** Where a kernel group runs, for people: its notebook's path, else its folder. */
export function groupWhere(group: IKernelGroup): string {
  return group.notebook || group.cwd || 'unknown notebook';
}

/** A machine name that keeps its end visible when the sidebar is narrow: the head
 * shrinks with an ellipsis, the last TAIL characters never do; the full name is the tooltip. */
export function machineName(id: string, cls = 'sb-id'): HTMLElement {
  const name = el('span', `${cls} sb-name`, null, { title: id });
  const cut = Math.max(0, id.length - TAIL);
  name.appendChild(el('span', 'sb-name-head', id.slice(0, cut)));
  name.appendChild(el('span', 'sb-name-tail', id.slice(cut)));
  return name;
}

/** Every machine below ``id`` in its group (through parent links), depth first. */
export function below(group: IKernelGroup, id: string): string[] {
  const out: string[] = [];
  const todo = [id];
  while (todo.length) {
    const cur = todo.pop()!;
    for (const m of group.machines) {
      if (m.parent === cur) {
        out.push(m.id);
        todo.push(m.id);
      }
    }
  }
  return out.sort();
}

/** The Delete dialog's question: the machine, whether it is active, what goes with it and
 * where the active machine goes (the Workbench's rule: to the deleted node's live parent). */
export function deleteQuestion(group: IKernelGroup, m: IMachine): string {
  const gone = below(group, m.id);
  const n = gone.length;
  const parts = [
    `Delete machine ${m.id} of ${basename(groupWhere(group))}` +
      (n ? ` and the ${n} branch${n === 1 ? '' : 'es'} below it (${gone.slice(0, 6).join(', ')}${n > 6 ? ', …' : ''})?` : '?')
  ];
  const active = group.active;
  if (active && (active === m.id || gone.includes(active))) {
    const parent = m.parent && group.machines.some(x => x.id === m.parent) ? m.parent : null;
    parts.push(
      (active === m.id ? `${m.id} is the active machine` : `The active machine ${active} goes with it`) +
        (parent ? `: ${parent} becomes active.` : ': no machine will be active (`%smol use NODE` picks one).')
    );
  } else if (active) {
    parts.push(`The active machine ${active} stays active.`);
  }
  parts.push("Its state can't be brought back (a checkpoint can).");
  return parts.join(' ');
}

/** What changed between two snapshots, in words: the active machine moved (``moves``), a
 * kernel died (``deaths``). */
export function changes(before: IMachines | null, after: IMachines): { moves: string[]; deaths: string[] } {
  const out: string[] = [];
  const deaths: string[] = [];
  if (!before) {
    return { moves: out, deaths };
  }
  const old = new Map(before.kernels.map(g => [g.kernel_id + (g.orphaned ? '~' : ''), g]));
  for (const g of after.kernels) {
    const prev = old.get(g.kernel_id + (g.orphaned ? '~' : ''));
    const where = basename(groupWhere(g));
    if (g.orphaned) {
      if (!old.has(g.kernel_id + '~') && old.get(g.kernel_id)?.kernel_alive) {
        deaths.push(`${where}: kernel ${g.kernel_id.slice(0, 8)} died; ` + (g.machines.every(m => m.unverified)
          ? 'its machines are listed as unverified (they may still run: delete them with their backend\'s own tools)'
          : 'its machines are listed as orphaned (Kill ends them)'));
      }
      continue;
    }
    if (!prev || prev.active === g.active) {
      continue;
    }
    const was = prev.active;
    const still = g.machines.some(m => m.id === was);
    if (!g.active) {
      if (g.machines.length) {
        out.push(`${where}: ${was} ${still ? 'is no longer active' : 'was deleted'}: no machine is active (\`%smol use NODE\` picks one)`);
      }
    } else if (was && !still) {
      out.push(`${where}: ${was} was deleted: the active machine is now ${g.active}`);
    } else {
      out.push(`${where}: the active machine is now ${g.active}` + (was ? ` (was ${was})` : ''));
    }
  }
  for (const d of after.dead ?? []) {
    const seen = before.dead?.some(x => x.kernel_id === d.kernel_id && x.at === d.at);
    if (!seen) {
      deaths.push(`${basename(d.notebook || d.cwd || 'a notebook')}: kernel ${d.kernel_id.slice(0, 8)} died; ` +
        `its ${d.machines} machine${d.machines === 1 ? '' : 's'} died with it`);
    }
  }
  return { moves: out, deaths };
}

/** Past this many machines in all, a group that isn't the current notebook's starts collapsed. */
export const COLLAPSE_AFTER = 24;
/** An open group shows this many machines, then "Show more" (so 100 machines stay usable). */
export const GROUP_PAGE = 25;

/** How the panel remembers each group's collapse and page (keyed by groupKey). */
export interface IGroupView {
  open: Map<string, boolean>;
  shown: Map<string, number>;
  current: string | null; // the current notebook's path: its group starts open
  onChange: () => void;
}

export function groupKey(group: IKernelGroup): string {
  return group.kernel_id + (group.orphaned ? '~' : '');
}

/** A group's summary: "student3.ipynb · 9 machines · 8 running" (what a collapsed group shows). */
export function groupSummary(group: IKernelGroup): string {
  const n = group.machines.length;
  const running = group.machines.filter(m => m.status === 'running' || m.status === 'starting').length;
  const where = basename(groupWhere(group));
  return `${group.orphaned ? 'orphaned · ' : ''}${where} · ${n} machine${n === 1 ? '' : 's'} · ${running} running`;
}

export function renderMachines(body: HTMLElement, snap: IMachines, onDelete: DeleteMachine, view?: IGroupView): void {
  const t0 = performance.now();
  body.replaceChildren();
  const skipped = snap.skipped ?? [];
  for (const line of skipped.slice(0, SKIPPED_SHOWN)) {
    body.appendChild(el('div', 'sb-problem', `machine registry: ${line}`));
  }
  if (skipped.length > SKIPPED_SHOWN) {
    body.appendChild(el('div', 'sb-problem', `machine registry: ${skipped.length - SKIPPED_SHOWN} more not read`));
  }
  if (!snap.kernels.length) {
    body.appendChild(el('div', 'sb-empty', 'No machines: `%smol up` in a notebook starts one.'));
    return;
  }
  const total = snap.kernels.reduce((a, g) => a + g.machines.length, 0);
  for (const group of snap.kernels) {
    body.appendChild(renderGroup(group, onDelete, total, view));
  }
  // how long this render took, for the browser test to report (never asserted)
  body.dataset.renderMs = (performance.now() - t0).toFixed(2);
  body.dataset.rows = String(body.querySelectorAll('.sb-machine').length);
}

function renderGroup(group: IKernelGroup, onDelete: DeleteMachine, total: number, view?: IGroupView): HTMLElement {
  const key = groupKey(group);
  const box = el('div', `sb-group${group.orphaned ? ' sb-orphaned' : ''}`, null, { 'data-kernel': group.kernel_id });
  const where = groupWhere(group);
  const kernel = `kernel ${group.kernel_id.slice(0, 8)}`;
  const mine = view?.current !== null && view?.current !== undefined && group.notebook === view.current;
  const open = view?.open.get(key) ?? (total <= COLLAPSE_AFTER || mine);
  const title = el('div', 'sb-group-title', null, { title: `${where}\nkernel ${group.kernel_id}\n${group.backend} backend` });
  const toggle = el('button', 'sb-group-toggle', null, {
    type: 'button',
    'aria-expanded': String(open),
    title: `${open ? 'Collapse' : 'Expand'} the machines of ${basename(where)}`
  });
  toggle.appendChild(el('span', 'sb-caret', open ? '\u25be' : '\u25b8'));
  toggle.appendChild(el('span', 'sb-group-nb', groupSummary(group)));
  toggle.addEventListener('click', ev => {
    ev.stopPropagation();
    view?.open.set(key, !open);
    view?.onChange();
  });
  title.appendChild(toggle);
  title.appendChild(el('span', 'sb-group-kernel',
    group.orphaned ? `${kernel} is dead · ${group.backend}` : `${kernel} · ${group.backend}`));
  box.appendChild(title);
  if (!open) {
    box.dataset.collapsed = 'true';
    return box;
  }
  if (!group.orphaned && !group.active && group.machines.length) {
    box.appendChild(el('div', 'sb-note', 'no machine is active: `%smol use NODE` picks one'));
  }
  const limit = view?.shown.get(key) ?? GROUP_PAGE;
  const shown = group.machines.slice(0, limit);
  const active = group.machines.find(m => m.active);
  if (active && !shown.includes(active)) {
    shown.push(active); // the active machine always shows
  }
  for (const m of shown) {
    box.appendChild(renderMachine(group, m, onDelete));
  }
  const left = group.machines.length - shown.length;
  if (left > 0) {
    box.appendChild(button(`Show ${Math.min(GROUP_PAGE, left)} more (${left} not shown)`, 'sb-more sb-group-more', () => {
      view?.shown.set(key, limit + GROUP_PAGE);
      view?.onChange();
    }));
  }
  return box;
}

function renderMachine(group: IKernelGroup, m: IMachine, onDelete: DeleteMachine): HTMLElement {
  const row = el('div', `sb-row sb-machine${m.active ? ' sb-active' : ''}`, null, {
    'data-id': m.id,
    'data-orphaned': String(m.orphaned)
  });
  if (m.active) {
    row.setAttribute('aria-current', 'true');
  }
  const depth = Math.min(m.id.split('.').length - 1, 4);
  row.style.paddingLeft = `${8 + depth * 8}px`;
  const line1 = el('div', 'sb-line');
  line1.appendChild(machineName(m.id));
  if (m.active) {
    line1.appendChild(el('span', 'sb-active-mark', 'active', { title: 'cells run in this machine' }));
  }
  const state = m.unverified ? 'unverified' : m.orphaned ? 'orphaned' : m.status || 'idle';
  line1.appendChild(el('span', `sb-status sb-st-${m.orphaned ? 'orphaned' : state}`, state));
  row.appendChild(line1);

  const line2 = el('div', 'sb-line sb-line2');
  line2.appendChild(el('span', 'sb-num', duration(m.uptime_s), { title: 'uptime' }));
  const used = m.memory_used_mib === null ? '' : `${memory(Math.round(m.memory_used_mib))}/`;
  line2.appendChild(el('span', 'sb-num sb-mem', `${used}${memory(m.memory_mib)}`, {
    title: m.memory_used_mib === null
      ? 'memory limit (Smolfile)'
      : `${m.memory_measure} of the machine's agent process / memory limit (Smolfile)` +
        (m.memory_measure === 'RSS' ? '; RSS counts pages shared with forks in full' : '')
  }));
  if (m.orphaned) {
    const kill = button('Kill', 'jp-mod-warn sb-kill', () => onDelete(group, m, true),
      m.killable
        ? 'Its kernel is dead: kill the host process holding this machine'
        : `Its kernel is dead and its ${m.backend} machine has no host process to check or kill from here: ` +
          'it may still run; delete it with its backend\'s own tools');
    kill.disabled = !m.killable;
    kill.setAttribute('aria-label', `Kill orphaned machine ${m.id}`);
    line2.appendChild(kill);
  } else {
    const del = button('', 'sb-delete sb-icon-btn', () => onDelete(group, m, false),
      `Delete ${m.id} and everything below it (asks first)`);
    del.setAttribute('aria-label', `Delete machine ${m.id}`);
    deleteIcon.element({ container: del, tag: 'span', elementSize: 'normal' });
    line2.appendChild(del);
  }
  row.appendChild(line2);
  if (m.node) {
    row.appendChild(whereLine(m));
  }
  return row;
}

/** A cluster machine's node: its short id, backend kind and host (all text: a host name is data). */
export function whereLine(m: IMachine): HTMLElement {
  const node = m.node || '';
  const kind = m.node_backend || '?';
  const line = el('div', `sb-line sb-where${m.node_lost ? ' sb-where-lost' : ''}`, null, {
    title: `Ray node ${node}\n${kind} backend` + (m.node_host ? `\nhost ${m.node_host}` : '') +
      (m.node_lost ? '\nthis node was lost: the next cell or fork rebuilds the machine on another node' : '')
  });
  line.appendChild(el('span', 'sb-where-node', `node ${node.slice(0, 8)}`));
  line.appendChild(el('span', 'sb-where-kind', kind));
  if (m.node_lost) {
    line.appendChild(el('span', 'sb-where-state', 'lost'));
  }
  if (m.node_host) {
    line.appendChild(el('span', 'sb-where-host', m.node_host));
  }
  return line;
}
