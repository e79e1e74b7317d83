"""Every notebook as a learner meets it: JupyterLab in headless Chromium, run all, move the sliders.

    .venv/bin/python tests/browser/run_notebooks.py [--only 04 06] [--screenshots] [--quick]

`make test-browser` runs it (after installing chromium and playwright where they are missing);
`make screenshots` adds --screenshots, which rewrites docs/images/ (CI only checks they exist).
One JupyterLab server and one browser for all notebooks `notebooks/[0-9]*.ipynb`. For each:
clear the outputs, run all through the front end, wait until every code cell has an execution
count and the kernel is idle, and fail on any error output. Then every ipywidgets explorer
(`interact`) in it: each control moved across its range, one at a time, the others at their
first values — every option of a dropdown or toggle; every value of a slider of up to 11, else
both ends, the second and every 5th (by the keyboard, as a learner can) — and back; after each
move the explorer's output must redraw, without an error or a traceback. Every wait has a
timeout; a failure names the notebook, the cell or the control's setting, and the error text.

`--quick` (CI, `make test-browser BROWSER_ARGS=--quick`) checks only what nbval, which has run
every notebook already, cannot: rendering and widgets. Each notebook is opened as committed, not
run: its kernel, no error output, every committed image decoded and shown, no "Error displaying
widget". In a notebook with explorers only the cells the explorers need are run (the cells
defining the names they use, and so on back), and each control is moved to its far end and back.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import re
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab import KERNEL, ROOT, TOKEN, Lab, browser  # noqa: E402

NOTEBOOK_TIMEOUT = 300   # s: run-all of one notebook (each runs in well under a minute)
REDRAW_TIMEOUT = 60      # s: one explorer redraw
MAX_STEPS = 10          # a slider of up to 11 values: every one; a longer one: every 5th
IMAGES = ROOT / "docs" / "images"
ERROR_TEXT = re.compile(r"Traceback|\b\w*(Error|Exception)\b:|Error displaying widget")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
WIDGET = "application/vnd.jupyter.widget-view+json"  # the mime type of a widget's output


class Failure(AssertionError):
    pass


# --- the notebook, through JupyterLab's own commands (the menu's Run > Run All Cells) ---------

OPEN = """async (path) => {
  const app = window.jupyterapp;
  const w = await app.commands.execute('docmanager:open', {path, factory: 'Notebook'});
  await w.context.ready; await w.sessionContext.ready;
  app.shell.activateById(w.id); window.__nb = w;
  return w.sessionContext.session?.kernel?.name;
}"""

RUN_ALL = """async () => {
  const app = window.jupyterapp;
  await app.commands.execute('notebook:clear-all-cell-outputs');
  app.commands.execute('notebook:run-all-cells');  // polled below, with a timeout
}"""

RUN_CELLS = """async (indices) => {
  const app = window.jupyterapp, w = window.__nb;
  for (const i of indices) {  // one at a time, in order: each resolves when its cell has run
    w.content.activeCellIndex = i; w.content.deselectAll();
    await app.commands.execute('notebook:run-cell');
  }
}"""

STATE = """() => {
  const w = window.__nb, cells = [];
  let index = 0;
  for (const c of w.content.model.cells) {
    index += 1;
    if (c.type !== 'code' || !c.sharedModel.getSource().trim()) continue;
    const errors = c.outputs.toJSON().filter(o => o.output_type === 'error')
      .map(o => (o.traceback || []).join('\\n') || `${o.ename}: ${o.evalue}`);
    cells.push({index, count: c.executionCount, errors,
                source: c.sharedModel.getSource().split('\\n')[0]});
  }
  return {status: w.sessionContext.session?.kernel?.status, cells,
          page: w.content.node.innerText.includes('Error displaying widget')};
}"""

RENDERED = """() => {
  const w = window.__nb, node = w.content.node;
  const imgs = [...node.querySelectorAll('.jp-RenderedImage img')];
  const images = w.content.model.toJSON().cells.flatMap(c => c.outputs || [])
    .filter(o => Object.keys(o.data || {}).some(m => m.startsWith('image/'))).length;
  return {images, shown: imgs.filter(i => !i.closest('.jupyter-widgets')).length,
          loading: imgs.filter(i => !i.complete).length,
          broken: imgs.filter(i => i.complete && !i.naturalWidth).length,
          text: ['Error displaying widget', 'No renderer could be found']
            .filter(t => node.innerText.includes(t))};
}"""

CLOSE = """async () => {
  const w = window.__nb; await w.context.save(); await w.sessionContext.shutdown(); w.dispose();
}"""


def evaluate(page, script: str, arg=None, timeout: float = 120):
    """page.evaluate with a timeout (Playwright's has none): a JupyterLab promise that never
    settles fails the notebook instead of hanging the run."""
    late = f"new Error('no answer from JupyterLab in {timeout} s')"
    race = (f"async (arg) => Promise.race([({script})(arg), "
            f"new Promise((_, no) => setTimeout(() => no({late}), {timeout * 1000}))])")
    return page.evaluate(race, arg)


def open_notebook(page, path: str) -> None:
    """Opens ``path`` in JupyterLab, as a learner does; fails unless its kernel is its
    kernelspec's."""
    kernel = evaluate(page, OPEN, path)
    wanted = json.loads((ROOT / path).read_text())["metadata"].get("kernelspec", {}).get("name")
    if kernel != wanted:
        raise Failure(f"{path}: opened with kernel {kernel!r}, not its kernelspec's {wanted!r}")
    if kernel != KERNEL:
        print(f"     note: {path} asks for kernel {kernel!r}; `make lab` provides {KERNEL!r}")


def run_all(page, path: str) -> str:
    """Clears the outputs and runs every cell (Run > Run All Cells); says what it did."""
    evaluate(page, RUN_ALL)
    deadline, state = time.monotonic() + NOTEBOOK_TIMEOUT, None
    while time.monotonic() < deadline:
        state = _state_without_errors(page, path)
        if state["status"] == "idle" and all(c["count"] for c in state["cells"]):
            break
        time.sleep(0.5)
    else:
        waiting = [c["index"] for c in state["cells"] if not c["count"]] if state else "?"
        raise Failure(f"{path}: run-all not done after {NOTEBOOK_TIMEOUT} s (kernel "
                      f"{state and state['status']}; cells without a count: {waiting})")
    if state["page"]:
        raise Failure(f"{path}: 'Error displaying widget' in the page")
    return "run all"


def _state_without_errors(page, path: str) -> dict:
    """The notebook's state (STATE); fails on the first cell with an error output."""
    state = page.evaluate(STATE)
    errors = [c for c in state["cells"] if c["errors"]]
    if errors:
        cell = errors[0]
        text = ANSI.sub("", cell["errors"][0])
        raise Failure(f"{path}: cell {cell['index']} ({cell['source']!r}) raised:\n{text}")
    return state


# --- --quick: the committed outputs as rendered, and only what the explorers need run ---------

def run_quick(page, path: str) -> str:
    """The committed outputs checked as rendered, then the cells the explorers need run; says
    what it did."""
    check_rendered(page, path)
    cells = cells_the_explorers_need(path)
    if cells:
        run_cells(page, path, cells)
    return f"outputs rendered, {len(cells)} cells run" if cells else "outputs rendered"


def check_rendered(page, path: str) -> None:
    """The committed outputs, as JupyterLab shows them without running anything: no error
    output, every image decoded and in the page, no widget that failed to display."""
    _state_without_errors(page, path)
    deadline, seen = time.monotonic() + REDRAW_TIMEOUT, None
    while time.monotonic() < deadline:
        seen = page.evaluate(RENDERED)
        if seen["text"]:
            raise Failure(f"{path}: {seen['text'][0]!r} in the page")
        if seen["broken"]:
            raise Failure(f"{path}: {seen['broken']} of its images could not be decoded")
        if seen["shown"] == seen["images"] and not seen["loading"]:
            return
        time.sleep(0.5)
    raise Failure(f"{path}: {seen['shown']} of its {seen['images']} images in the page, "
                  f"{seen['loading']} still loading, after {REDRAW_TIMEOUT} s")


def cells_the_explorers_need(path: str) -> list[int]:
    """Indices of the cells that display a widget (their committed output says so), and of
    the cells defining the names these use — the latest definition before each — and so on."""
    cells = json.loads((ROOT / path).read_text())["cells"]
    code = {i: _names(c["source"]) for i, c in enumerate(cells) if c["cell_type"] == "code"}
    needed = [i for i in code if any(WIDGET in o.get("data", {}) for o in cells[i]["outputs"])]
    todo = list(needed)
    while todo:
        cell = todo.pop()
        for name in code[cell][0]:
            earlier = [i for i in code if i < cell and name in code[i][1]]
            if earlier and earlier[-1] not in needed:
                needed.append(earlier[-1])
                todo.append(earlier[-1])
    return sorted(needed)


def _names(source: str | list[str]) -> tuple[set[str], set[str]]:
    """(names a cell uses but does not define, names it defines)."""
    used, defined = set(), set()
    for node in ast.walk(ast.parse("".join(source))):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
    return used - defined, defined


def run_cells(page, path: str, cells: list[int]) -> None:
    """Runs ``cells`` (0-based indices), in order; fails on an error output."""
    evaluate(page, RUN_CELLS, cells, timeout=NOTEBOOK_TIMEOUT)
    state = _state_without_errors(page, path)
    if state["page"]:
        raise Failure(f"{path}: 'Error displaying widget' in the page")


# --- the explorers: every ipywidgets control of every interact, moved --------------------------

def _output_text(explorer) -> str:
    return explorer.locator(".widget-output").inner_text()


def _settings(explorer) -> str:
    """The explorer's current setting, in words: 'label=value, …'."""
    return explorer.evaluate("""e => [...e.children].filter(c => !c.matches('.widget-output'))
      .map(c => `${c.querySelector('label')?.innerText || '?'}=` +
                (c.querySelector('select')?.value ?? c.querySelector('.widget-readout')?.innerText
                 ?? c.querySelector('.noUi-handle')?.getAttribute('aria-valuetext') ?? '?'))
      .join(', ')""")


def _mark(explorer) -> None:
    explorer.evaluate("""e => e.querySelectorAll('.widget-output .jp-OutputArea-child')
      .forEach(c => c.dataset.seen = '1')""")


def _wait_redraw(page, explorer, where: str) -> None:
    """A new output in the explorer, the kernel idle again; then no error text in it."""
    deadline = time.monotonic() + REDRAW_TIMEOUT
    while time.monotonic() < deadline:
        fresh = explorer.evaluate("""e => e.querySelectorAll(
          '.widget-output .jp-OutputArea-child:not([data-seen])').length""")
        idle = page.evaluate("() => window.__nb.sessionContext.session?.kernel?.status") == "idle"
        if fresh and idle:
            time.sleep(0.2)  # a last message in flight
            if page.evaluate("() => window.__nb.sessionContext.session?.kernel?.status") == "idle":
                break
        time.sleep(0.1)
    else:
        raise Failure(f"{where}: the explorer did not redraw within {REDRAW_TIMEOUT} s")
    text = _output_text(explorer)
    if ERROR_TEXT.search(text):
        raise Failure(f"{where}: the explorer shows an error:\n{ANSI.sub('', text)[-2000:]}")


def _slider(handle) -> tuple[int, int]:
    """(position, number of steps) of a noUiSlider: ipywidgets' Int/Float/SelectionSlider."""
    return tuple(handle.evaluate("""h => { const s = h.closest('.noUi-target').noUiSlider;
      const {range, step} = s.options, n = Math.round((range.max - range.min) / step);
      return [Math.round((Number(s.get(true)) - range.min) / step), n]; }"""))


def _keys(at: int, to: int, n: int) -> list[str]:
    """Keys that move a slider from step `at` to step `to`: noUiSlider's Home/End, PageUp/Down
    (five steps) and arrows — a learner's keyboard."""
    if to in (0, n):
        return ["Home" if to == 0 else "End"]
    d = to - at
    page, arrow = ("PageUp", "ArrowRight") if d > 0 else ("PageDown", "ArrowLeft")
    return [page] * (abs(d) // 5) + [arrow] * (abs(d) % 5)


def _sweep_control(page, explorer, control, where: str, ends_only: bool) -> list[str]:
    """Moves one control across its range (``ends_only``: to both ends), back to where it was;
    returns the settings tried."""
    tried = []

    def move(action) -> None:
        before = _settings(explorer)
        _mark(explorer)
        action()
        after = _settings(explorer)
        if after != before:
            _wait_redraw(page, explorer, f"{where}: {after}")
            tried.append(after)

    select = control.locator("select")
    if select.count():
        values = select.evaluate("s => [...s.options].map(o => o.value)")
        first = select.input_value()
        for value in [values[0], values[-1], first] if ends_only else values + [first]:
            move(lambda value=value: select.select_option(value))
        return tried
    handle = control.locator(".noUi-handle")
    if handle.count():  # every value of a short range; of a long one, both ends and every 5th
        handle.focus()
        start, n = _slider(handle)
        if ends_only:
            stops = [0, n]
        elif n <= MAX_STEPS:
            stops = list(range(n + 1))
        else:
            stops = [0, 1, *range(6, n, 5), n]
        for to in [*stops, start]:
            at = _slider(handle)[0]
            move(lambda at=at, to=to: [handle.press(k) for k in _keys(at, to, n)])
            if _slider(handle)[0] != to:
                raise Failure(f"{where}: the slider did not move to step {to} of {n}: "
                              f"{_settings(explorer)}")
        return tried
    buttons = control.locator("button")
    if buttons.count():
        last = buttons.count() - 1
        for i in [0, last, 0] if ends_only else [*range(last + 1), 0]:
            move(lambda i=i: buttons.nth(i).click())
        return tried
    checkbox = control.locator("input[type=checkbox]")
    if checkbox.count():
        for _ in range(2):
            move(lambda: checkbox.click())
        return tried
    raise Failure(f"{where}: a control this test does not know how to move: "
                  f"{control.get_attribute('class')}")


def explore(page, path: str, log, verbose: bool = False, ends_only: bool = False) -> int:
    """Every explorer of the open notebook, every control; returns how many settings were drawn."""
    explorers = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .widget-interact")
    drawn = 0
    for e in range(explorers.count()):
        explorer = explorers.nth(e)
        explorer.scroll_into_view_if_needed()
        if ERROR_TEXT.search(_output_text(explorer)):
            raise Failure(f"{path}: explorer {e + 1} shows an error at its first setting")
        controls = explorer.locator(":scope > :not(.widget-output)")
        for c in range(controls.count()):
            control = controls.nth(c)
            label = control.locator("label").first.inner_text() if control.locator(
                "label").count() else f"control {c + 1}"
            tried = _sweep_control(page, explorer, control, f"{path}: explorer {e + 1}",
                                   ends_only)
            log(f"    explorer {e + 1} {label}: {len(tried)} redraws, no error")
            for setting in tried if verbose else []:
                log(f"      {setting}")
            drawn += len(tried)
    return drawn


# --- screenshots: docs/images/ (only with --screenshots; CI checks that they exist) -----------

def screenshot(page, path: str) -> list[Path]:
    from PIL import Image

    stem = Path(path).name[:2]
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    shots = []
    images = panel.locator(".jp-Cell:not(:has(.widget-interact)) .jp-RenderedImage img")
    areas = images.evaluate_all("imgs => imgs.map(i => i.naturalWidth * i.naturalHeight)")
    targets = []
    if areas:
        targets.append((images.nth(areas.index(max(areas))), IMAGES / f"{stem}_figure.png"))
    explorers = panel.locator(".widget-interact")
    for e in range(explorers.count()):
        suffix = "" if explorers.count() == 1 else f"_{e + 1}"
        targets.append((explorers.nth(e), IMAGES / f"{stem}_explorer{suffix}.png"))
    IMAGES.mkdir(parents=True, exist_ok=True)
    for element, out in targets:
        element.scroll_into_view_if_needed()
        element.screenshot(path=str(out), animations="disabled", timeout=30_000)
        image = Image.open(out).convert("RGB")
        image.thumbnail((720, 720))  # at most 720 px a side
        image.quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
        shots.append(out)
    return shots


# --- the run ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=[], help="notebook numbers, e.g. 04 06")
    parser.add_argument("--screenshots", action="store_true", help="rewrite docs/images/")
    parser.add_argument("--no-explore", action="store_true", help="run all, move no control")
    parser.add_argument("--quick", action="store_true",
                        help="CI, after nbval: open each notebook as committed; run only what its "
                             "explorers need, move each control to its ends")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every setting drawn")
    args = parser.parse_args(argv)
    notebooks = sorted(p.relative_to(ROOT).as_posix()
                       for p in ROOT.glob("notebooks/[0-9]*.ipynb")
                       if not args.only or p.name[:2] in args.only)
    log = functools.partial(print, flush=True)
    # a CI timeout's SIGTERM unwinds like an exception: the server and the browser still stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))
    start, failures, shots = time.monotonic(), [], []
    # a tall window for screenshots: a tall explorer is taken whole, not cut at the window's edge
    with Lab() as lab, browser(height=4000 if args.screenshots else 1000) as page:
        page.set_default_timeout(30_000)
        page.goto(f"{lab.url}/lab?token={TOKEN}", timeout=60_000)
        page.wait_for_function("() => window.jupyterapp", timeout=60_000)
        evaluate(page, "async () => { await window.jupyterapp.started; "
                       "await window.jupyterapp.restored; }")
        log(f"JupyterLab and Chromium up in {time.monotonic() - start:.1f} s")
        for path in notebooks:
            t = time.monotonic()
            try:
                open_notebook(page, path)
                done = run_quick(page, path) if args.quick else run_all(page, path)
                took = time.monotonic() - t
                drawn = 0 if args.no_explore else explore(page, path, log, args.verbose,
                                                          ends_only=args.quick)
                if args.screenshots:
                    shots += screenshot(page, path)
                log(f"ok   {path}: {done} {took:.1f} s" +
                    (f", {drawn} explorer redraws {time.monotonic() - t - took:.1f} s"
                     if drawn else ""))
            except Failure as failure:
                failures.append(str(failure))
                log(f"FAIL {failure}")
            except Exception as error:  # a Playwright timeout, a page that went away
                failures.append(f"{path}: {type(error).__name__}: {error}")
                log(f"FAIL {failures[-1]}")
            finally:
                try:
                    evaluate(page, CLOSE, timeout=60)
                except Exception as error:  # the page may be gone: the Lab's exit stops kernels
                    log(f"     (closing {path}: {type(error).__name__})")
    for out in shots:
        log(f"wrote {out.relative_to(ROOT)} ({out.stat().st_size // 1024} KB)")
    log(f"{len(notebooks) - len(failures)}/{len(notebooks)} notebooks passed in "
        f"{time.monotonic() - start:.0f} s")
    if failures:
        log("\n".join(["", "FAILURES:", *failures]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
