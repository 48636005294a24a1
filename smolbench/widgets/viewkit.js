// Shared by every smolbench widget view (prepended to each view's module by _base.view_module):
// the element helper and the kernel watch.

function h(tag, cls, text) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  if (text !== undefined && text !== null) el.textContent = String(text);
  return el;
}

// The views follow their kernel: once it dies, restarts or shuts down, its machines are gone
// (sandboxes die with their kernel) and no click can reach them.
const GONE = new Set(["dead", "autorestarting", "restarting", "terminating"]);
const GONE_TEXT =
  "the kernel is gone (it died, restarted or was shut down) and these machines with it: run the notebook again";

// Whether the kernel is running a cell (a click then waits in its queue): the view's own `busy`
// (the kernel sets it on its newest view only), else the kernel's status where the frontend
// shows it (JupyterLab, Notebook 7).
function kernelBusy(model) {
  if (model.get("busy")) return true;
  try {
    const kernel = model.widget_manager && model.widget_manager.kernel;
    return Boolean(kernel && kernel.status === "busy");
  } catch (e) {
    return false;
  }
}

function watchKernel(model, onGone) {
  const manager = model.widget_manager;
  let kernel = null;
  try {
    kernel = manager && manager.kernel;
  } catch (e) {
    kernel = null;
  }
  if (!kernel || !kernel.statusChanged) return () => {};
  let gone = false;
  const check = (status) => {
    if (!gone && GONE.has(status)) {
      gone = true;
      onGone(status);
    }
  };
  const onStatus = (_, status) => check(status);
  kernel.statusChanged.connect(onStatus);
  const onConnection = (_, status) => {
    if (status === "disconnected") check(kernel.status === "dead" ? "dead" : "");
  };
  if (kernel.connectionStatusChanged) kernel.connectionStatusChanged.connect(onConnection);
  check(kernel.status);
  return () => {
    kernel.statusChanged.disconnect(onStatus);
    if (kernel.connectionStatusChanged) kernel.connectionStatusChanged.disconnect(onConnection);
  };
}
