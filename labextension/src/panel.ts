/**
 * The "smolbench" sidebar: Machines (live, grouped by notebook/kernel; orphans of dead
 * kernels with Kill), Checkpoints (restore into the active notebook, delete), and Runs
 * (the ledger beside the active notebook, newest first).
 *
 * Refresh is a poll: machines every POLL_MS (a few small JSON files on the server), the
 * ledger and checkpoints when the machines change, when the notebook changes, or every
 * LEDGER_EVERY polls.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { refreshIcon } from '@jupyterlab/ui-components';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { APIError, ICheckpoint, IMachines, IRun, IRuns, request } from './api';
import {
  NAME_RE,
  NODE_RE,
  button,
  duration,
  el,
  firstLine,
  memory,
  reward,
  size,
  sparkline,
  stamp,
  when
} from './format';

export const POLL_MS = 1000;
const LEDGER_EVERY = 5;
const RUNS_PAGE = 20;

/** What the panel needs from JupyterLab (the active notebook and its kernel). */
export interface IHost {
  notebookPath(): string | null;
  notebookDir(): string | null;
  runInKernel(code: string): Promise<string>;
  insertCell(source: string): boolean;
  openRun(dir: string, run: IRun): void;
}

export class SmolPanel extends Widget {
  constructor(host: IHost) {
    super();
    this.host = host;
    this.id = 'smolbench-panel';
    this.addClass('jp-smolbench');
    this.title.caption = 'smolbench: machines, checkpoints and runs';
    const head = el('div', 'sb-head');
    head.appendChild(el('span', 'sb-title', 'smolbench'));
    const refresh = button('', 'sb-refresh', () => void this.refresh(true), 'Refresh now');
    refreshIcon.element({ container: refresh, tag: 'span', elementSize: 'normal' });
    head.appendChild(refresh);
    this.node.appendChild(head);
    this.errorNode = this.node.appendChild(el('div', 'sb-error'));
    this.msgNode = this.node.appendChild(el('div', 'sb-msg'));
    this.machinesNode = this.section('Machines', 'sb-machines');
    this.checkpointsNode = this.section('Checkpoints', 'sb-checkpoints');
    this.runsNode = this.section('Runs', 'sb-runs');
  }

  /** Emitted with each new machines snapshot (the status bar listens). */
  get machinesChanged(): ISignal<this, IMachines> {
    return this._machinesChanged;
  }

  get machines(): IMachines | null {
    return this._machines;
  }

  private section(title: string, cls: string): HTMLElement {
    const sec = el('section', `sb-section ${cls}`);
    sec.appendChild(el('h3', 'sb-section-title', title));
    const body = el('div', 'sb-body');
    sec.appendChild(body);
    this.node.appendChild(sec);
    return body;
  }

  /** One poll: machines always; ledger and checkpoints when something changed. */
  async refresh(all = false): Promise<void> {
    this.ticks++;
    const dir = this.host.notebookDir() ?? '';
    let changed = false;
    try {
      const snap = await request<IMachines>('machines');
      const sig = JSON.stringify(snap.kernels.map(k => [k.kernel_id, k.orphaned, k.machines.map(m => [m.id, m.active, m.status])]));
      changed = sig !== this.machineSig;
      this.machineSig = sig;
      this._machines = snap;
      this.setError('machines', null);
      this.renderMachines(snap);
      this._machinesChanged.emit(snap);
    } catch (err) {
      this.setError('machines', err);
    }
    if (all || changed || dir !== this.dir || this.ticks % LEDGER_EVERY === 0) {
      this.dir = dir;
      await Promise.all([this.refreshRuns(), this.refreshCheckpoints()]);
    }
  }

  private errors = new Map<string, string>();

  private setError(what: string, err: unknown): void {
    if (err === null) {
      this.errors.delete(what);
    } else {
      this.errors.set(what, err instanceof APIError ? err.message : `${what}: ${String(err)}`);
    }
    this.errorNode.textContent = [...new Set(this.errors.values())].join('\n');
    this.errorNode.style.display = this.errors.size ? '' : 'none';
  }

  private say(text: string, level: 'info' | 'error' = 'info'): void {
    this.msgNode.textContent = text;
    this.msgNode.dataset.level = level;
    this.msgNode.style.display = text ? '' : 'none';
  }

  // -- machines --------------------------------------------------------------------

  private renderMachines(snap: IMachines): void {
    const body = this.machinesNode;
    body.replaceChildren();
    if (!snap.kernels.length) {
      body.appendChild(el('div', 'sb-empty', 'No machines: `%smol up` in a notebook starts one.'));
      return;
    }
    for (const group of snap.kernels) {
      const box = el('div', `sb-group${group.orphaned ? ' sb-orphaned' : ''}`, null, {
        'data-kernel': group.kernel_id
      });
      const where = group.notebook || group.cwd || 'unknown notebook';
      const label = group.orphaned
        ? `orphaned · kernel ${group.kernel_id.slice(0, 8)} is dead · ${group.backend}`
        : `${where} · kernel ${group.kernel_id.slice(0, 8)} · ${group.backend}`;
      box.appendChild(el('div', 'sb-group-title', label, { title: `${where}\nkernel ${group.kernel_id}` }));
      for (const m of group.machines) {
        const row = el('div', `sb-row sb-machine${m.active ? ' sb-active' : ''}`, null, {
          'data-id': m.id,
          'data-orphaned': String(m.orphaned)
        });
        const depth = m.id.split('.').length - 1;
        const name = el('span', 'sb-id', m.id);
        name.style.paddingLeft = `${Math.min(depth, 8) * 10}px`;
        row.appendChild(name);
        const state = m.unverified ? 'unverified' : m.orphaned ? 'orphaned' : m.status || 'idle';
        row.appendChild(el('span', `sb-status sb-st-${m.orphaned ? 'orphaned' : state}`, state));
        row.appendChild(el('span', 'sb-num', duration(m.uptime_s), { title: 'uptime' }));
        const used = m.memory_used_mib === null ? '' : `${memory(Math.round(m.memory_used_mib))}/`;
        row.appendChild(el('span', 'sb-num sb-mem', `${used}${memory(m.memory_mib)}`, {
          title: m.memory_used_mib === null
            ? 'memory limit (Smolfile)'
            : `${m.memory_measure} of the machine's agent process / memory limit (Smolfile)` +
              (m.memory_measure === 'RSS' ? '; RSS counts pages shared with forks in full' : '')
        }));
        if (m.orphaned) {
          const kill = button('Kill', 'jp-mod-warn sb-kill', () => void this.deleteMachine(group.kernel_id, m.id, true),
            m.killable
              ? 'Its kernel is dead: kill the host process holding this machine'
              : `Its kernel is dead and its ${m.backend} machine has no host process to check or kill from here: ` +
                'it may still run; delete it with its backend\'s own tools');
          kill.disabled = !m.killable;
          row.appendChild(kill);
        } else {
          row.appendChild(button('Delete', 'sb-delete', () => void this.deleteMachine(group.kernel_id, m.id, false),
            `Ask kernel ${group.kernel_id.slice(0, 8)} to delete ${m.id} and everything below it`));
        }
        box.appendChild(row);
      }
      body.appendChild(box);
    }
  }

  private async deleteMachine(kernel: string, id: string, orphan: boolean): Promise<void> {
    this.say(orphan ? `killing ${id}…` : `asking kernel ${kernel.slice(0, 8)} to delete ${id}…`);
    try {
      const res = await request<{ message: string }>(
        `machines/${encodeURIComponent(kernel)}/${encodeURIComponent(id)}`, { orphaned: orphan ? 1 : 0 }, { method: 'DELETE' });
      this.say(res.message);
    } catch (err) {
      this.say(err instanceof Error ? err.message : String(err), 'error');
    }
    await this.refresh(true);
  }

  // -- checkpoints -------------------------------------------------------------------

  private async refreshCheckpoints(): Promise<void> {
    try {
      const data = await request<{ checkpoints: ICheckpoint[]; problems: string[] }>('checkpoints');
      this.setError('checkpoints', null);
      this.renderCheckpoints(data.checkpoints, data.problems);
    } catch (err) {
      this.setError('checkpoints', err);
    }
  }

  private renderCheckpoints(items: ICheckpoint[], problems: string[]): void {
    const body = this.checkpointsNode;
    body.replaceChildren();
    for (const p of problems) {
      body.appendChild(el('div', 'sb-problem', p));
    }
    if (!items.length) {
      body.appendChild(el('div', 'sb-empty', 'No checkpoints: `%smol checkpoint save NAME` makes one.'));
      return;
    }
    const here = this.host.notebookDir();
    for (const c of items) {
      const row = el('div', 'sb-row sb-checkpoint', null, { 'data-name': c.name, 'data-dir': c.dir });
      const name = el('span', 'sb-id', c.name, { title: `${c.path}\nin ${c.dir || '(root)'}/` });
      row.appendChild(name);
      row.appendChild(el('span', 'sb-node', c.node_id, { title: 'node' }));
      row.appendChild(el('span', 'sb-backend', c.backend));
      row.appendChild(el('span', 'sb-num', c.exists ? size(c.size) : 'missing', { title: 'size' }));
      row.appendChild(el('span', 'sb-when', when(c.created), { title: stamp(c.created) }));
      const restore = button('Restore', 'jp-mod-accept sb-restore', () => void this.restore(c), '');
      const why =
        here === null ? 'open a notebook first'
          : here !== c.dir ? `this checkpoint is in ${c.dir || 'the root folder'}/: open a notebook there to restore it`
          : !c.exists ? 'its file is missing'
          : !NAME_RE.test(c.name) ? 'not a valid checkpoint name' : '';
      restore.disabled = Boolean(why);
      restore.title = why || `Run %smol checkpoint restore ${c.name} in this notebook's kernel`;
      row.appendChild(restore);
      row.appendChild(button('Delete', 'jp-mod-warn sb-delete', () => void this.deleteCheckpoint(c), 'Delete this checkpoint (asks first)'));
      body.appendChild(row);
    }
  }

  private async restore(c: ICheckpoint): Promise<void> {
    if (!NAME_RE.test(c.name) || !/^[a-z]+$/.test(c.backend)) {
      return;
    }
    const code = [
      'import smolbench as _sb',
      'if _sb._magics is None: get_ipython().run_line_magic("load_ext", "smolbench")',
      'if _sb._magics.workbench is None or _sb._magics.workbench.active is None:',
      `    get_ipython().run_line_magic("smol", "up --backend ${c.backend}")`,
      `%smol checkpoint restore ${c.name}`
    ].join('\n');
    this.say(`restoring ${c.name} into ${this.host.notebookPath() ?? 'the notebook'}…`);
    try {
      const out = await this.host.runInKernel(code);
      const lines = out.split('\n').filter(l => l.trim());
      this.say(lines.length ? lines[lines.length - 1] : `restored ${c.name}`);
    } catch (err) {
      this.say(err instanceof Error ? err.message : String(err), 'error');
    }
    await this.refresh(true);
  }

  private async deleteCheckpoint(c: ICheckpoint): Promise<void> {
    const answer = await showDialog({
      title: 'Delete checkpoint',
      body: `Delete checkpoint "${c.name}" (${size(c.size)}, node ${c.node_id}) and its file? This can't be undone.`,
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Delete' })]
    });
    if (!answer.button.accept) {
      return;
    }
    try {
      const res = await request<{ message: string }>(`checkpoints/${encodeURIComponent(c.name)}`, { path: c.dir }, { method: 'DELETE' });
      this.say(res.message);
    } catch (err) {
      this.say(err instanceof Error ? err.message : String(err), 'error');
    }
    await this.refreshCheckpoints();
  }

  // -- runs --------------------------------------------------------------------------

  private async refreshRuns(): Promise<void> {
    const dir = this.dir;
    const title = this.runsNode.parentElement?.querySelector('.sb-section-title');
    if (title) {
      title.textContent = `Runs in ${dir ? dir + '/' : 'the root folder'}`;
    }
    try {
      const data = await request<IRuns>('ledger/runs', { path: dir, limit: this.runsShown });
      this.setError('runs', null);
      this.renderRuns(data);
    } catch (err) {
      this.setError('runs', null);
      this.runsNode.replaceChildren(el('div', 'sb-problem', err instanceof Error ? err.message : String(err)));
    }
  }

  private renderRuns(data: IRuns): void {
    const body = this.runsNode;
    body.replaceChildren();
    if (data.note) {
      body.appendChild(el('div', 'sb-empty', data.note));
      return;
    }
    if (!data.runs.length) {
      body.appendChild(el('div', 'sb-empty', 'No runs yet: `%%smol fork N` records one.'));
      return;
    }
    for (const run of data.runs) {
      const row = el('div', 'sb-row sb-run', null, { 'data-run': run.id, title: `${run.code || ''}\n\nclick: open the tree` });
      row.appendChild(el('span', 'sb-cell', firstLine(run.code) || `(${run.kind})`));
      row.appendChild(el('span', 'sb-num sb-n', `${run.kind === 'episodes' ? 'ep ' : '×'}${run.n ?? '?'}`));
      row.appendChild(el('span', 'sb-num sb-best', reward(run.best_reward), { title: 'best reward' }));
      row.appendChild(sparkline(run.spark));
      row.appendChild(el('span', 'sb-when', when(run.started), { title: stamp(run.started) }));
      const best = run.best_node;
      const replay = button('Replay', 'sb-replay', () => this.replay(best ?? ''),
        best ? `Insert a %smol replay ${best} cell (the run's best branch) in the notebook` : 'no rewarded branch to replay');
      replay.disabled = !best || !NODE_RE.test(best);
      row.appendChild(replay);
      row.addEventListener('click', () => this.host.openRun(this.dir, run));
      body.appendChild(row);
    }
    if (data.total > data.runs.length) {
      body.appendChild(button(`Show more (${data.total - data.runs.length} older)`, 'sb-more', () => {
        this.runsShown += RUNS_PAGE;
        void this.refreshRuns();
      }));
    }
  }

  replay(node: string): void {
    if (!NODE_RE.test(node)) {
      return;
    }
    if (this.host.insertCell(`%smol replay ${node}`)) {
      this.say(`inserted a %smol replay ${node} cell: run it to rebuild the branch and compare its reward`);
    } else {
      this.say('open a notebook to insert the replay cell into', 'error');
    }
  }

  private host: IHost;
  private errorNode: HTMLElement;
  private msgNode: HTMLElement;
  private machinesNode: HTMLElement;
  private checkpointsNode: HTMLElement;
  private runsNode: HTMLElement;
  private machineSig = '';
  private dir = "\u0000"; // no folder yet: the first refresh loads the ledger
  private ticks = 0;
  private runsShown = RUNS_PAGE;
  private _machines: IMachines | null = null;
  private _machinesChanged = new Signal<this, IMachines>(this);
}
