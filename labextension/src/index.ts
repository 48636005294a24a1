/**
 * smolbench's JupyterLab extension: the "smolbench" left sidebar and a status-bar item
 * (`smol: sandbox · 3 machines`) that opens it. It asks only for the application's shell
 * (not JupyterLab's own), so Notebook 7 shows the same sidebar on its notebook page.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, MainAreaWidget } from '@jupyterlab/apputils';
import { IMainMenu } from '@jupyterlab/mainmenu';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { IMachines, IRun } from './api';
import { dirname } from './format';
import { IHost, POLL_MS, SmolPanel } from './panel';
import { RunTree } from './tree';

const ICON_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16"><g class="jp-icon3" fill="#616161">' +
  '<rect x="3" y="3" width="8" height="6" rx="1"/><rect x="13" y="15" width="8" height="6" rx="1"/>' +
  '<rect x="3" y="15" width="8" height="6" rx="1"/><path d="M6.5 9h1v3H17v3h-1v-2H7.5v2h-1z"/></g></svg>';

export const smolIcon = new LabIcon({ name: 'smolbench:icon', svgstr: ICON_SVG });

const ANSI = /\x1b\[[0-9;]*m/g;

function statusText(snap: IMachines | null): string {
  if (!snap) {
    return 'smol: …';
  }
  const backend = snap.backends.join('+') || 'idle';
  const n = snap.machines;
  let text = `smol: ${backend} · ${n} machine${n === 1 ? '' : 's'}`;
  if (snap.orphaned) {
    text += ` · ${snap.orphaned} orphaned`;
  }
  return text;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'smolbench:plugin',
  description: 'A sidebar for smolbench machines, checkpoints and past runs.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [IStatusBar, ICommandPalette, IMainMenu],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    statusBar: IStatusBar | null,
    palette: ICommandPalette | null,
    mainMenu: IMainMenu | null
  ) => {
    const shell = app.shell;
    let panel: SmolPanel;
    const host: IHost = {
      notebookPath: () => tracker.currentWidget?.context.path ?? null,
      notebookDir: () => {
        const path = tracker.currentWidget?.context.path;
        return path === undefined ? null : dirname(path);
      },
      runInKernel: async (code: string) => {
        const kernel = tracker.currentWidget?.sessionContext.session?.kernel;
        if (!kernel) {
          throw new Error('open a notebook with a running kernel first');
        }
        const out: string[] = [];
        let failure = '';
        const future = kernel.requestExecute({ code, store_history: false, allow_stdin: false });
        future.onIOPub = msg => {
          const content = msg.content as any;
          if (msg.header.msg_type === 'stream') {
            out.push(String(content.text ?? ''));
          } else if (msg.header.msg_type === 'error') {
            failure = `${content.ename}: ${content.evalue}`.replace(ANSI, '');
          }
        };
        const reply = await future.done;
        if ((reply.content as any).status !== 'ok') {
          const c = reply.content as any;
          throw new Error(failure || `${c.ename ?? 'error'}: ${c.evalue ?? ''}`.replace(ANSI, ''));
        }
        return out.join('').replace(ANSI, '');
      },
      insertCell: (source: string) => {
        const nb = tracker.currentWidget?.content;
        if (!nb || !nb.model) {
          return false;
        }
        const index = Math.max(0, nb.activeCellIndex + 1);
        nb.model.sharedModel.insertCell(index, { cell_type: 'code', source });
        nb.activeCellIndex = index;
        shell.activateById(tracker.currentWidget!.id);
        return true;
      },
      insertAndRun: async (source: string) => {
        const widget = tracker.currentWidget;
        const nb = widget?.content;
        if (!widget || !nb || !nb.model) {
          return null;
        }
        const index = Math.max(0, nb.activeCellIndex + 1);
        nb.model.sharedModel.insertCell(index, { cell_type: 'code', source });
        nb.activeCellIndex = index;
        nb.deselectAll();
        shell.activateById(widget.id);
        const cell = nb.model.cells.get(index);
        const ok = await NotebookActions.run(nb, widget.sessionContext);
        const out: string[] = [];
        for (const o of cell.toJSON().outputs as any[] ?? []) {
          if (o.output_type === 'stream') {
            out.push(Array.isArray(o.text) ? o.text.join('') : String(o.text ?? ''));
          } else if (o.output_type === 'error') {
            out.push(`${o.ename}: ${o.evalue}`);
          }
        }
        const text = out.join('').replace(ANSI, '');
        if (!ok) {
          throw new Error(text.trim().split('\n').pop() || `the inserted cell \`${source}\` failed`);
        }
        return text;
      },
      openRun: (dir: string, run: IRun) => {
        const content = new RunTree(dir, run, node => panel.replay(node));
        const existing = [...shell.widgets('main')].find(w => w.id === `${content.id}-area`);
        if (existing) {
          content.dispose();
          shell.activateById(existing.id);
          return;
        }
        const widget = new MainAreaWidget({ content });
        widget.id = `${content.id}-area`;
        widget.title.label = content.title.label;
        widget.title.caption = content.title.caption;
        widget.title.icon = smolIcon;
        widget.title.closable = true;
        shell.add(widget, 'main');
        shell.activateById(widget.id);
      }
    };

    panel = new SmolPanel(host);
    panel.title.icon = smolIcon;
    shell.add(panel, 'left', { rank: 600 });

    app.commands.addCommand('smolbench:open', {
      label: 'Show the smolbench sidebar',
      execute: () => shell.activateById(panel.id)
    });
    // Notebook 7 has no status bar: the View menu and the palette open the sidebar there
    palette?.addItem({ command: 'smolbench:open', category: 'smolbench' });
    mainMenu?.viewMenu.addGroup([{ command: 'smolbench:open' }], 100);

    if (statusBar) {
      const item = new Widget();
      item.addClass('jp-smolbench-status');
      item.node.textContent = statusText(null);
      item.node.title = 'smolbench machines: click to open the sidebar';
      item.node.addEventListener('click', () => shell.activateById(panel.id));
      panel.machinesChanged.connect((_, snap) => {
        item.node.textContent = statusText(snap);
      });
      statusBar.registerStatusItem('smolbench:status', { item, align: 'left', rank: 100 });
    }

    // Poll (not push): the machines listing is a few small files on the server, and a
    // poll needs no long-lived connection; a hidden browser tab skips its turn.
    let busy = false;
    const tick = async () => {
      if (busy || document.hidden) {
        return;
      }
      busy = true;
      try {
        await panel.refresh();
      } finally {
        busy = false;
      }
    };
    tracker.currentChanged.connect(() => void tick());
    void app.restored.then(() => {
      void tick();
      window.setInterval(() => void tick(), POLL_MS);
    });
  }
};

export default plugin;
