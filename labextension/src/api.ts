/**
 * The smolbench server extension's REST API, called through JupyterLab's own
 * ServerConnection (so the server's token, cookies and XSRF rules apply).
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface IMachine {
  id: string;
  parent: string | null;
  backend: string;
  uptime_s: number | null;
  memory_mib: number | null;
  memory_used_mib: number | null;
  memory_measure: string;
  cpus: number | null;
  status: string;
  reward: number | null;
  active: boolean;
  orphaned: boolean;
  unverified: boolean;
  killable: boolean;
  /** The Ray node of a cluster machine (null for a machine on the kernel's own host). */
  node?: string | null;
  node_host?: string | null;
  node_backend?: string | null;
  node_lost?: boolean;
}

export interface IKernelGroup {
  kernel_id: string;
  notebook: string | null;
  cwd: string;
  backend: string;
  session: string;
  kernel_alive: boolean;
  orphaned: boolean;
  active: string | null;
  machines: IMachine[];
}

/** A kernel that died with all its machines (reported for a minute). */
export interface IDeadKernel {
  kernel_id: string;
  notebook: string | null;
  cwd: string;
  machines: number;
  at: number;
}

export interface IMachines {
  kernels: IKernelGroup[];
  machines: number;
  orphaned: number;
  backends: string[];
  dead?: IDeadKernel[];
  /** Registry files over a cap, not read (each one line, the server's words). */
  skipped?: string[];
}

export interface ICheckpoint {
  name: string;
  node_id: string;
  backend: string;
  size: number | null;
  created: number | null;
  dir: string;
  /** The folder it was saved in, as the server says it (ckpt's API; until then: ``dir``). */
  folder?: string;
  path: string;
  exists: boolean;
}

export interface IRun {
  id: string;
  session_id: string;
  kind: string;
  parent_id: string | null;
  code: string | null;
  n: number | null;
  started: number | null;
  ended: number | null;
  status: string | null;
  best_reward: number | null;
  best_node: string | null;
  spark: number[];
  notebook?: string | null;
  cell?: number | null;
  /** Whether %smol replay can rebuild its best branch (false: a gym run, whose episodes it refuses). */
  replayable?: boolean;
  /** Why not, in one line (the server's words, as %smol replay says it). */
  replay_refused?: string | null;
}

export interface IRuns {
  total: number;
  runs: IRun[];
  notebooks?: { notebook: string | null; runs: number }[];
  note?: string;
  dir?: string;
}

export interface INode {
  id: string;
  parent_id: string | null;
  run_id: string | null;
  seed: number | null;
  status: string | null;
  reward: number | null;
  started: number | null;
  ended: number | null;
  alive: boolean;
  kept: boolean;
  error: string | null;
  output: string | null;
  metrics: Record<string, unknown>;
  /** The Ray node it ran on (cluster runs), else null. */
  host_node?: string | null;
  /** Why %smol replay refuses it (a gym episode), in one line; else null. */
  replay_refused?: string | null;
}

export interface INodes {
  total: number;
  offset: number;
  limit: number;
  run: (Partial<IRun> & { id: string }) | null;
  nodes: INode[];
  note?: string;
}

/** An API error, carrying the server's one-line message. */
export class APIError extends Error {}

export async function request<T>(
  path: string,
  params: Record<string, string | number | undefined> = {},
  init: RequestInit = {}
): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const query = Object.entries(params)
    .filter(([, v]) => v !== undefined)
    .map(([k, v]) => `${encodeURIComponent(k)}=${encodeURIComponent(String(v))}`)
    .join('&');
  const url =
    URLExt.join(settings.baseUrl, 'smolbench', 'api', path) + (query ? `?${query}` : '');
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (err) {
    throw new APIError(`the Jupyter server is not answering (${String(err)}): is it still running?`);
  }
  const text = await response.text();
  let data: any = {};
  try {
    data = text ? JSON.parse(text) : {};
  } catch {
    data = { message: text.slice(0, 200) };
  }
  if (!response.ok) {
    const msg = data.message || data.reason || response.statusText;
    if (response.status === 404 && !data.message) {
      throw new APIError(
        'the smolbench server extension is not enabled: `jupyter server extension enable smolbench.server`, then restart JupyterLab'
      );
    }
    throw new APIError(`${msg} (HTTP ${response.status})`);
  }
  return data as T;
}
