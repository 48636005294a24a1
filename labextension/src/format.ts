/** Small formatting and DOM helpers (text only: every string may come from a machine). */

export function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  cls = '',
  text?: string | null,
  attrs: Record<string, string> = {}
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (cls) {
    node.className = cls;
  }
  if (text !== undefined && text !== null) {
    node.textContent = text;
  }
  for (const [k, v] of Object.entries(attrs)) {
    node.setAttribute(k, v);
  }
  return node;
}

export function button(
  label: string,
  cls: string,
  onClick: () => void,
  title = ''
): HTMLButtonElement {
  const b = el('button', `jp-Button jp-mod-styled jp-mod-small sb-btn ${cls}`, label);
  b.type = 'button';
  if (title) {
    b.title = title;
  }
  b.addEventListener('click', ev => {
    ev.stopPropagation();
    onClick();
  });
  return b;
}

export function reward(value: number | null | undefined): string {
  if (value === null || value === undefined || !isFinite(value)) {
    return '—';
  }
  return Number.isInteger(value) ? String(value) : value.toPrecision(4).replace(/\.?0+$/, '');
}

export function duration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined) {
    return '—';
  }
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) {
    return `${s}s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)}m ${s % 60}s`;
  }
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

export function memory(mib: number | null | undefined): string {
  if (!mib) {
    return '—';
  }
  return mib >= 1024 ? `${(mib / 1024).toFixed(mib % 1024 ? 1 : 0)} GiB` : `${mib} MiB`;
}

export function size(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined) {
    return '—';
  }
  const units = ['B', 'kB', 'MB', 'GB'];
  let v = bytes;
  let i = 0;
  while (v >= 1000 && i < units.length - 1) {
    v /= 1000;
    i++;
  }
  return `${i ? v.toFixed(1) : v} ${units[i]}`;
}

export function when(ts: number | null | undefined): string {
  if (!ts) {
    return '—';
  }
  const ago = Date.now() / 1000 - ts;
  if (ago < 60) {
    return 'just now';
  }
  if (ago < 3600) {
    return `${Math.floor(ago / 60)} min ago`;
  }
  const d = new Date(ts * 1000);
  const pad = (n: number) => String(n).padStart(2, '0');
  const day = `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}`;
  return `${day} ${pad(d.getHours())}:${pad(d.getMinutes())}`;
}

export function stamp(ts: number | null | undefined): string {
  return ts ? new Date(ts * 1000).toLocaleString() : '';
}

const SVG = 'http://www.w3.org/2000/svg';

/**
 * Where `v` lies between `lo` and `hi` (0 to 1). In halves where `hi - lo` overflows:
 * rewards of -1.7e308 and 1.7e308 made every point NaN and the line vanished.
 */
export function share(v: number, lo: number, hi: number): number {
  const span = hi - lo;
  if (!(span > 0)) {
    return 0;
  }
  return Number.isFinite(span) ? (v - lo) / span : (v / 2 - lo / 2) / (hi / 2 - lo / 2);
}

/** A tiny reward sparkline (the run's rewards, sorted). */
export function sparkline(values: number[], width = 60, height = 16): SVGSVGElement {
  const svg = document.createElementNS(SVG, 'svg');
  svg.setAttribute('class', 'sb-spark');
  svg.setAttribute('width', String(width));
  svg.setAttribute('height', String(height));
  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
  if (values.length) {
    const lo = Math.min(...values);
    const hi = Math.max(...values);
    const step = values.length > 1 ? (width - 2) / (values.length - 1) : 0;
    const pts = values.map((v, i) => {
      const x = 1 + i * step;
      const y = height - 2 - share(v, lo, hi) * (height - 4);
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    });
    const line = document.createElementNS(SVG, 'polyline');
    line.setAttribute('points', values.length > 1 ? pts.join(' ') : `1,${height / 2} ${width - 1},${height / 2}`);
    svg.appendChild(line);
  }
  return svg;
}

export const NAME_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;
export const NODE_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;

export function dirname(path: string): string {
  const i = path.lastIndexOf('/');
  return i < 0 ? '' : path.slice(0, i);
}

export function basename(path: string): string {
  return path.slice(path.lastIndexOf('/') + 1);
}

export function firstLine(code: string | null | undefined): string {
  const lines = (code || '').split('\n').filter(l => l.trim());
  const body = lines.filter(l => !l.startsWith('%%'));
  return (body[0] || lines[0] || '').trim();
}

/** A node id's natural order: root.2 before root.10. */
export function compareIds(a: string, b: string): number {
  const pa = a.replace(/-/g, '.').split('.');
  const pb = b.replace(/-/g, '.').split('.');
  for (let i = 0; i < Math.min(pa.length, pb.length); i++) {
    const na = /^\d+$/.test(pa[i]);
    const nb = /^\d+$/.test(pb[i]);
    if (na && nb && Number(pa[i]) !== Number(pb[i])) {
      return Number(pa[i]) - Number(pb[i]);
    }
    if (na !== nb) {
      return na ? -1 : 1;
    }
    if (!na && pa[i] !== pb[i]) {
      return pa[i] < pb[i] ? -1 : 1;
    }
  }
  return pa.length - pb.length;
}

/** The one rule for "best" (smolbench.tree.best_key): the highest reward, and on a tie the
 * node first in natural order, so Replay, ★best and the run summary agree. */
export function bestOf<T extends { id: string; reward: number | null }>(nodes: T[]): T | null {
  let top: T | null = null;
  for (const n of nodes) {
    if (n.reward === null || !isFinite(n.reward)) {
      continue;
    }
    if (top === null || n.reward > (top.reward as number) ||
        (n.reward === top.reward && compareIds(n.id, top.id) < 0)) {
      top = n;
    }
  }
  return top;
}
