/**
 * A read-only view of one past run's tree, from the ledger: the run's parent, its
 * branches and the forks nested under them, coloured by status, best path marked.
 * Click a node for its output and error (shown as text); Replay inserts a cell.
 */
import { Widget } from '@lumino/widgets';

import { INode, INodes, IRun, request } from './api';
import { NODE_RE, basename, bestOf, button, duration, el, reward, stamp } from './format';
import { kindText, localTime } from './runs';

const PAGE = 200;

/** What a run is called for people: "a.ipynb [4] · fork ×8 · 14:03:22" (its ledger id is in the caption). */
export function runLabel(run: IRun): string {
  const where = run.notebook ? basename(run.notebook) : 'notebook not recorded';
  return `${where}${run.cell ? ` [${run.cell}]` : ''} · ${kindText(run)} · ${localTime(run.started)}`;
}

export class RunTree extends Widget {
  constructor(dir: string, run: IRun, replay: (node: string) => void) {
    super();
    this.dir = dir;
    this.run = run;
    this.replay = replay;
    this.addClass('jp-smolbench-tree');
    this.id = `smolbench-run-${run.id.replace(/[^A-Za-z0-9_-]/g, '-')}`;
    this.title.label = runLabel(run);
    this.title.caption = `${runLabel(run)}, ${stamp(run.started)}\n${dir ? `${dir}/` : 'the root folder'} · ledger run ${run.id}`;
    this.title.closable = true;
    this.head = this.node.appendChild(el('div', 'sb-tree-head'));
    this.list = this.node.appendChild(el('div', 'sb-tree-list'));
    this.more = this.node.appendChild(el('div', 'sb-tree-more'));
    this.detail = this.node.appendChild(el('div', 'sb-tree-detail'));
    void this.load();
  }

  private async load(): Promise<void> {
    try {
      const data = await request<INodes>('ledger/nodes', {
        path: this.dir,
        run: this.run.id,
        limit: PAGE,
        offset: this.nodes.length
      });
      this.nodes.push(...data.nodes);
      this.total = data.total;
      this.render();
    } catch (err) {
      this.list.replaceChildren(el('div', 'sb-problem', err instanceof Error ? err.message : String(err)));
    }
  }

  private render(): void {
    const run = this.run;
    this.head.replaceChildren(
      el('div', 'sb-tree-title', `${runLabel(run)} · ${run.n ?? '?'} branches from ${run.parent_id ?? 'fresh machines'} · best ${reward(run.best_reward)} · ${run.status ?? ''}`),
      el('div', 'sb-tree-when', `${stamp(run.started)}${run.ended && run.started ? ` · took ${duration(run.ended - run.started)}` : ''}`),
      el('pre', 'sb-tree-code', run.code ?? '')
    );
    const byParent = new Map<string, INode[]>();
    const ids = new Set(this.nodes.map(n => n.id));
    const roots: INode[] = [];
    for (const n of this.nodes) {
      if (n.parent_id && ids.has(n.parent_id)) {
        const kids = byParent.get(n.parent_id) ?? [];
        kids.push(n);
        byParent.set(n.parent_id, kids);
      } else {
        roots.push(n);
      }
    }
    const best = this.bestPath();
    const key = (n: INode) => n.id.split('.').map(p => (/^\d+$/.test(p) ? p.padStart(8, '0') : p)).join('.');
    const rows: HTMLElement[] = [];
    const walk = (n: INode, depth: number) => {
      const row = el('div', `sb-tree-row sb-st-${n.status ?? 'unknown'}${best.has(n.id) ? ' sb-best' : ''}${n.id === this.selected ? ' sb-selected' : ''}`,
        null, { 'data-id': n.id, 'data-status': n.status ?? '' });
      const name = el('span', 'sb-id', n.id);
      name.style.paddingLeft = `${depth * 14}px`;
      row.appendChild(name);
      row.appendChild(el('span', 'sb-seed', n.seed === null ? '' : `seed ${n.seed}`));
      row.appendChild(el('span', `sb-status sb-st-${n.status ?? 'unknown'}`, n.status ?? '?'));
      row.appendChild(el('span', 'sb-num sb-reward', reward(n.reward)));
      // a deleted machine is never "kept", whatever its row once said
      row.appendChild(el('span', 'sb-alive', n.alive ? (n.kept ? 'kept' : 'alive') : 'deleted'));
      if (n.host_node) {
        row.appendChild(el('span', 'sb-where-node', `@${n.host_node.slice(0, 8)}`, { title: `Ray node ${n.host_node}` }));
      }
      row.addEventListener('click', () => {
        this.selected = n.id;
        this.render();
      });
      rows.push(row);
      for (const k of (byParent.get(n.id) ?? []).sort((a, b) => (key(a) < key(b) ? -1 : 1))) {
        walk(k, depth + 1);
      }
    };
    roots.sort((a, b) => (key(a) < key(b) ? -1 : 1)).forEach(r => walk(r, 0));
    this.list.replaceChildren(...rows);
    this.more.replaceChildren();
    if (this.total > this.nodes.length) {
      this.more.appendChild(button(`Load ${Math.min(PAGE, this.total - this.nodes.length)} more of ${this.total - this.nodes.length}`, 'sb-more', () => void this.load()));
    }
    this.renderDetail();
  }

  private bestPath(): Set<string> {
    const top = bestOf(this.nodes.filter(n => n.run_id === this.run.id && n.status === 'ok'));
    const out = new Set<string>();
    const byId = new Map(this.nodes.map(n => [n.id, n]));
    for (let n: INode | undefined = top ?? undefined; n; n = n.parent_id ? byId.get(n.parent_id) : undefined) {
      out.add(n.id);
    }
    return out;
  }

  private renderDetail(): void {
    const n = this.nodes.find(x => x.id === this.selected);
    if (!n) {
      this.detail.replaceChildren(el('div', 'sb-empty', 'Click a node for its output.'));
      return;
    }
    const parts: HTMLElement[] = [
      el('div', 'sb-tree-title', `${n.id} · ${n.status ?? '?'} · reward ${reward(n.reward)}${n.seed !== null ? ` · seed ${n.seed}` : ''}${n.started && n.ended ? ` · ${duration(n.ended - n.started)}` : ''}` +
        (n.host_node ? ` · node ${n.host_node.slice(0, 8)}` : ''))
    ];
    const metrics = Object.entries(n.metrics || {});
    if (metrics.length) {
      parts.push(el('div', 'sb-metrics', metrics.map(([k, v]) => `${k}=${String(v)}`).join('  ')));
    }
    if (n.error) {
      parts.push(el('pre', 'sb-tree-error', n.error));
    }
    parts.push(el('pre', 'sb-tree-output', n.output || '(no output)'));
    const refused = n.replay_refused || null; // a gym episode: the server's one line
    const replay = button(`Replay ${n.id}`, 'sb-replay', () => this.replay(n.id),
      refused ?? `Insert a %smol replay ${n.id} cell in the active notebook`);
    replay.disabled = refused !== null || !NODE_RE.test(n.id) || n.parent_id === null;
    parts.push(replay);
    this.detail.replaceChildren(...parts);
  }

  private dir: string;
  private run: IRun;
  private replay: (node: string) => void;
  private head: HTMLElement;
  private list: HTMLElement;
  private more: HTMLElement;
  private detail: HTMLElement;
  private nodes: INode[] = [];
  private total = 0;
  private selected: string | null = null;
}
