/**
 * The Runs section's rows and notebook filter. A run reads "a.ipynb · [4] · fork ×8 ·
 * 14:03:22" (notebook, cell number, kind, local time), its first code line below it as
 * secondary text, then its best reward, a sparkline and Replay (disabled, saying why, for a
 * run whose best branch %smol replay refuses: a gym run's episodes).
 */
import { IRun, IRuns } from './api';
import { NODE_RE, basename, button, el, firstLine, reward, sparkline, stamp } from './format';

export const ALL = '\u0000all'; // the filter value for every notebook's runs
export const NONE = ''; // runs that name no notebook (ledgers from before the notebook column)

/** A run's kind and size: "fork ×8", "episodes ×4", or the kind as recorded. */
export function kindText(run: IRun): string {
  const n = run.n ?? '?';
  return run.kind === 'fork' || run.kind === 'episodes' ? `${run.kind} ×${n}` : run.kind || 'run';
}

/** Local time of day for today's runs, else the date and time. */
export function localTime(ts: number | null | undefined, now = new Date()): string {
  if (!ts) {
    return '—';
  }
  const d = new Date(ts * 1000);
  const pad = (n: number) => String(n).padStart(2, '0');
  const time = `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  if (d.toDateString() === now.toDateString()) {
    return time;
  }
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${time.slice(0, 5)}`;
}

/** The filter: this notebook (the default), each notebook of the ledger, all of them. */
export function renderFilter(
  data: IRuns, current: string | null, value: string, onChange: (value: string) => void
): HTMLSelectElement {
  const select = el('select', 'sb-runs-filter', null, { 'aria-label': 'Show the runs of' });
  const counts = new Map((data.notebooks ?? []).map(x => [x.notebook ?? NONE, x.runs]));
  const total = [...counts.values()].reduce((a, b) => a + b, 0);
  const add = (v: string, label: string) => {
    const opt = el('option', '', label, { value: v });
    opt.selected = v === value;
    select.appendChild(opt);
  };
  if (current !== null) {
    add(current, `this notebook (${basename(current)}) · ${counts.get(current) ?? 0}`);
  }
  for (const [nb, k] of counts) {
    if (nb !== current && nb !== NONE) {
      add(nb, `${nb} · ${k}`);
    }
  }
  if (counts.has(NONE)) {
    add(NONE, `notebook not recorded · ${counts.get(NONE)}`);
  }
  add(ALL, `all notebooks · ${total}`);
  select.addEventListener('change', () => onChange(select.value));
  return select;
}

export function renderRun(
  run: IRun, showNotebook: boolean, onOpen: () => void, onReplay: (node: string) => void
): HTMLElement {
  const code = firstLine(run.code);
  const where = run.notebook ? basename(run.notebook) : 'notebook not recorded';
  const row = el('div', 'sb-row sb-run', null, {
    'data-run': run.id,
    'data-notebook': run.notebook ?? '',
    title: `${run.notebook ?? where}${run.cell ? `, cell [${run.cell}]` : ''}, ${stamp(run.started)}\n\n` +
      `${run.code || ''}\n\nclick: open the tree`
  });
  const head = el('div', 'sb-line sb-run-label');
  if (showNotebook) {
    head.appendChild(el('span', 'sb-run-nb', where));
  }
  if (run.cell) {
    head.appendChild(el('span', 'sb-run-cellno', `[${run.cell}]`, { title: 'the cell\'s execution count' }));
  }
  head.appendChild(el('span', 'sb-kind', kindText(run)));
  head.appendChild(el('span', 'sb-when', localTime(run.started), { title: stamp(run.started) }));
  row.appendChild(head);
  row.appendChild(el('div', 'sb-line sb-cell', code || `(${run.kind})`));

  const tail = el('div', 'sb-line sb-run-result');
  tail.appendChild(el('span', 'sb-num sb-best', reward(run.best_reward), { title: 'best reward' }));
  tail.appendChild(sparkline(run.spark));
  const best = run.best_node;
  // the server says whether replay can rebuild this kind of run (a gym run's episodes: no)
  const refused = run.replayable === false ? run.replay_refused || `can't replay a ${run.kind} run` : null;
  const replay = button('Replay', 'sb-replay', () => onReplay(best ?? ''), refused ??
    (best ? `Insert a %smol replay ${best} cell (the run's best branch) in the notebook` : 'no rewarded branch to replay'));
  replay.disabled = refused !== null || !best || !NODE_RE.test(best);
  tail.appendChild(replay);
  row.appendChild(tail);
  row.addEventListener('click', onOpen);
  return row;
}
