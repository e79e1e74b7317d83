# megatron-edu: `make test` and `make lab` work on a fresh clone (they create .venv first).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch 2.13.0: a CPU build where one is provided locally, the CUDA build from PyPI elsewhere.
# On a GPU cluster pick your own: make install TORCH_SPEC="torch==2.13.0 --index-url ..."
TORCH_SPEC ?= torch==2.13.0
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: install kernel test test-browser screenshots lint lab train bench gpu-check student-notebooks clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH_SPEC)
	$(PIP) -e ".[notebooks,test]"
	touch $@

lint: install
	$(PY) -m ruff check .

# Unit tests and every notebook (nbval compares the committed outputs), in one pytest run.
# notebooks/[0-9]*.ipynb: the solution notebooks (not the generated student/ versions).
test: lint
	$(PY) -m pytest --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg \
		tests notebooks/[0-9]*.ipynb

# The project's environment as a Jupyter kernel inside .venv (the notebooks' kernelspec names it).
KERNEL := $(VENV)/share/jupyter/kernels/megatron-edu/kernel.json
kernel: $(KERNEL)

$(KERNEL): $(VENV)/.installed
	$(PY) -m ipykernel install --sys-prefix --name megatron-edu --display-name "Python 3 (megatron-edu)"

# JupyterLab on notebooks/: student/ holds the exercises to do (written on first use, never
# overwritten: your work stays), the numbered notebooks beside it their solutions.
lab: kernel student-notebooks
	@echo "Start in notebooks/student/ (the exercises to do); notebooks/NN_*.ipynb are the solutions."
	$(PY) -m jupyter lab notebooks

# Every notebook in JupyterLab in headless Chromium: run all, every explorer's controls moved
# (tests/browser/; installs Debian's chromium and Playwright where missing). CI, after `make test`
# has run every notebook: BROWSER_ARGS=--quick opens each as committed, runs only what its
# explorers need and moves each control to its ends (rendering and widgets, which nbval cannot see).
test-browser: kernel
	sh tests/browser/install.sh $(PY)
	$(PY) tests/browser/run_notebooks.py $(BROWSER_ARGS)

# The same run, rewriting the pictures in docs/images/ that the README shows (and the course map,
# drawn from the notebooks' "Before this" lines).
screenshots: kernel
	sh tests/browser/install.sh $(PY)
	$(PY) tests/browser/run_notebooks.py --screenshots
	$(PY) -m megatron_edu.course.viz.course_map notebooks docs/images/course_map.png

# The main job: the tiny GPT on the built-in corpus, tp=2 x pp=2 on 4 CPU processes (minutes).
train: install
	$(PY) -m megatron_edu.train --nproc 4 --tp 2 --pp 2 --out runs/default

# Benchmarks against plain PyTorch, DTensor and torch.distributed.pipelining (bench/README.md).
bench: install
	$(PY) -m bench

# On this machine's GPUs, under 8 minutes on one: CUDA tests, a bf16 GPT-2 medium run (tokens/s,
# MFU), the GPU benchmarks; one table. Makes .venv-gpu if .venv's torch sees no GPU. No GPU: says so.
gpu-check:
	@$(PYTHON) bench/gpu_check.py --torch-spec "$(TORCH_SPEC)"

# The notebooks without their solutions (each a stub the checkers answer "not done yet", every
# "read the code" cell that shows an answer held back until its exercise); existing ones are kept.
student-notebooks: install
	$(PY) -m megatron_edu.course.student notebooks notebooks/student

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
