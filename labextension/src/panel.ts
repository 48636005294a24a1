/**
 * The "smolbench" sidebar: Machines (live, grouped by notebook/kernel, the active one
 * marked; orphans of dead kernels with Kill), Checkpoints (restore into the active notebook,
 * delete), and Runs (the ledger beside the active notebook, newest first, of that notebook
 * unless another is picked). What changed between polls (the active machine moved, a
 * kernel died) is said in words.
 *
 * Refresh is a poll: machines every POLL_MS (a few small JSON files on the server), the
 * ledger and checkpoints when the machines change, when the notebook changes, or every
 * LEDGER_EVERY polls.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { refreshIcon } from '@jupyterlab/ui-components';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { APIError, ICheckpoint, IKernelGroup, IMachine, IMachines, IRun, IRuns, request } from './api';
import { NAME_RE, NODE_RE, button, el, size, stamp, when } from './format';
import { IGroupView, changes, deleteQuestion, renderMachines } from './machines';
import { ALL, renderFilter, renderRun } from './runs';

export const POLL_MS = 1000;

/** A folder for people: "the root folder", else "runs/a/". */
export function folderText(dir: string): string {
  return dir ? `${dir}/` : 'the root folder';
}
const LEDGER_EVERY = 5;
const RUNS_PAGE = 20;
const NOTE_AFTER_MS = 1500;

/** What the panel needs from JupyterLab (the active notebook and its kernel). */
export interface IHost {
  notebookPath(): string | null;
  notebookDir(): string | null;
  runInKernel(code: string): Promise<string>;
  insertCell(source: string): boolean;
  /** Insert a code cell below the active one and run it in the notebook (its output stays there). */
  insertAndRun(source: string): Promise<string | null>;
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
      const sig = JSON.stringify(snap.kernels.map(k => [k.kernel_id, k.orphaned, k.active, k.machines.map(m => [m.id, m.active, m.status])]));
      changed = sig !== this.machineSig;
      this.machineSig = sig;
      const { moves, deaths } = changes(this._machines, snap);
      // an action's own answer already says where the active machine went; a death is
      // always said (below that answer, when it is recent)
      const recent = Date.now() - this.saidAt < NOTE_AFTER_MS;
      const notes = [...(recent ? [] : moves), ...deaths];
      if (notes.length) {
        const text = recent && this.msgNode.textContent ? [this.msgNode.textContent, ...notes] : notes;
        this.say(text.join('\n'), 'info', false);
      }
      this._machines = snap;
      this.setError('machines', null);
      this.renderMachines();
      this._machinesChanged.emit(snap);
    } catch (err) {
      this.setError('machines', err);
    }
    const nb = this.host.notebookPath();
    if (all || changed || dir !== this.dir || nb !== this.notebook || this.ticks % LEDGER_EVERY === 0) {
      this.dir = dir;
      this.notebook = nb;
      await Promise.all([this.refreshRuns(), this.refreshCheckpoints()]);
    }
  }

  private renderMachines(): void {
    if (!this._machines) {
      return;
    }
    this.groups.current = this.host.notebookPath();
    renderMachines(this.machinesNode, this._machines, (g, m, orphan) => void this.deleteMachine(g, m, orphan), this.groups);
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

  private say(text: string, level: 'info' | 'error' = 'info', action = true): void {
    if (action) {
      this.saidAt = Date.now();
    }
    this.msgNode.textContent = text;
    this.msgNode.dataset.level = level;
    this.msgNode.style.display = text ? '' : 'none';
  }

  // -- machines --------------------------------------------------------------------

  private async deleteMachine(group: IKernelGroup, m: IMachine, orphan: boolean): Promise<void> {
    const kernel = group.kernel_id;
    if (!orphan) {
      const answer = await showDialog({
        title: 'Delete machine',
        body: deleteQuestion(group, m),
        buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Delete' })]
      });
      if (!answer.button.accept) {
        return;
      }
    }
    this.say(orphan ? `killing ${m.id}…` : `asking kernel ${kernel.slice(0, 8)} to delete ${m.id}…`);
    try {
      const res = await request<{ message: string }>(
        `machines/${encodeURIComponent(kernel)}/${encodeURIComponent(m.id)}`, { orphaned: orphan ? 1 : 0 }, { method: 'DELETE' });
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
      const folder = c.folder ?? c.dir;
      const row = el('div', 'sb-row sb-checkpoint', null, { 'data-name': c.name, 'data-dir': c.dir });
      const name = el('span', 'sb-id', c.name, { title: `${c.path}\nin ${folderText(folder)}` });
      row.appendChild(name);
      // two checkpoints of one name in two folders must not look the same
      row.appendChild(el('span', 'sb-ckpt-folder', folder ? `${folder}/` : 'root folder', { title: `saved in ${folderText(folder)}` }));
      row.appendChild(el('span', 'sb-node', c.node_id, { title: 'node' }));
      row.appendChild(el('span', 'sb-backend', c.backend));
      row.appendChild(el('span', 'sb-num', c.exists ? size(c.size) : 'missing', { title: 'size' }));
      row.appendChild(el('span', 'sb-when', when(c.created), { title: stamp(c.created) }));
      const restore = button('Restore', 'jp-mod-accept sb-restore', () => void this.restore(c), '');
      const why =
        here === null ? 'open a notebook first'
          : here !== c.dir ? `this checkpoint is in ${folderText(c.dir)}: open a notebook there to restore it`
          : !c.exists ? 'its file is missing'
          : !NAME_RE.test(c.name) ? 'not a valid checkpoint name' : '';
      restore.disabled = Boolean(why);
      restore.title = why || `Insert and run a %smol checkpoint restore ${c.name} cell (so Run All restores it again)`;
      row.appendChild(restore);
      row.appendChild(button('Delete', 'jp-mod-warn sb-delete', () => void this.deleteCheckpoint(c), 'Delete this checkpoint (asks first)'));
      body.appendChild(row);
    }
  }

  private async restore(c: ICheckpoint): Promise<void> {
    if (!NAME_RE.test(c.name) || !/^[a-z]+$/.test(c.backend)) {
      return;
    }
    // a kernel with no machine up gets one first (as the checkpoint's backend, but never the
    // process backend on a ledger row's word: a copied folder's row could say so, and its saved
    // state would load with no isolation); the restore itself is a cell in the notebook, so
    // Run All on a new kernel restores it again
    const backend = c.backend === 'process' ? 'sandbox' : c.backend;
    const prepare = [
      'import smolbench as _sb',
      'if _sb._magics is None: get_ipython().run_line_magic("load_ext", "smolbench")',
      'if _sb._magics.workbench is None or _sb._magics.workbench.active is None:',
      `    get_ipython().run_line_magic("smol", "up --backend ${backend}")`
    ].join('\n');
    const cell = `%smol checkpoint restore ${c.name}`;
    this.say(`restoring ${c.name} into ${this.host.notebookPath() ?? 'the notebook'}…`);
    try {
      await this.host.runInKernel(prepare);
      const out = await this.host.insertAndRun(cell);
      if (out === null) {
        this.say('open a notebook to insert the restore cell into', 'error');
      } else {
        const lines = out.split('\n').filter(l => l.trim());
        this.say(`${lines.length ? lines[lines.length - 1] : `restored ${c.name}`}\n` +
          `(from the inserted \`${cell}\` cell: Run All restores it again)`);
      }
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
    await this.refresh(true);
  }

  // -- runs --------------------------------------------------------------------------

  /** Which notebook's runs are shown: the one picked, while its notebook stays current;
   * else the current notebook's (every notebook's when none is open). */
  private runsFilter(): string {
    if (this.picked !== null && this.pickedWith === this.notebook) {
      return this.picked;
    }
    this.picked = null;
    return this.notebook ?? ALL;
  }

  private async refreshRuns(): Promise<void> {
    const dir = this.dir;
    const title = this.runsNode.parentElement?.querySelector('.sb-section-title');
    if (title) {
      title.textContent = `Runs in ${dir ? dir + '/' : 'the root folder'}`;
    }
    const filter = this.runsFilter();
    try {
      const data = await request<IRuns>('ledger/runs', {
        path: dir, limit: this.runsShown, notebook: filter === ALL ? undefined : filter
      });
      this.setError('runs', null);
      this.renderRuns(data, filter);
    } catch (err) {
      this.setError('runs', null);
      this.runsNode.replaceChildren(el('div', 'sb-problem', err instanceof Error ? err.message : String(err)));
    }
  }

  private renderRuns(data: IRuns, filter: string): void {
    const body = this.runsNode;
    body.replaceChildren();
    if (data.note) {
      body.appendChild(el('div', 'sb-empty', data.note));
      return;
    }
    body.appendChild(renderFilter(data, this.notebook, filter, value => {
      this.picked = value;
      this.pickedWith = this.notebook;
      this.runsShown = RUNS_PAGE;
      void this.refreshRuns();
    }));
    if (!data.runs.length) {
      body.appendChild(el('div', 'sb-empty', filter === ALL
        ? 'No runs yet: `%%smol fork N` records one.'
        : 'No runs of this notebook yet: `%%smol fork N` records one (pick another notebook above).'));
      return;
    }
    for (const run of data.runs) {
      body.appendChild(renderRun(run, filter === ALL || filter !== this.notebook,
        () => this.host.openRun(this.dir, run), node => this.replay(node)));
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

  private groups: IGroupView = {
    open: new Map(),
    shown: new Map(),
    current: null,
    onChange: () => this.renderMachines()
  };
  private host: IHost;
  private errorNode: HTMLElement;
  private msgNode: HTMLElement;
  private machinesNode: HTMLElement;
  private checkpointsNode: HTMLElement;
  private runsNode: HTMLElement;
  private machineSig = '';
  private dir = "\u0000"; // no folder yet: the first refresh loads the ledger
  private notebook: string | null = null;
  private picked: string | null = null; // the notebook filter picked by hand ...
  private pickedWith: string | null = null; // ... while this notebook was current
  private ticks = 0;
  private saidAt = 0;
  private runsShown = RUNS_PAGE;
  private _machines: IMachines | null = null;
  private _machinesChanged = new Signal<this, IMachines>(this);
}
