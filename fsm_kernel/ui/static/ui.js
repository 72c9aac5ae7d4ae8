// fsm-kernel run viewer: live refresh of the runs table, a run's page and the dispatches, and
// filtering a run's timeline by clicking its diagram. Everything shown comes from the server
// already escaped; this script only swaps those fragments in and hides or shows entries.
"use strict";
(function () {
  const page = document.body.dataset.page;

  function every(interval, work) {
    const tick = async () => {
      try {
        await work();
      } catch (err) {
        // The viewer may be restarting; the next tick tries again.
      }
      setTimeout(tick, (document.hidden ? 4 : 1) * interval());
    };
    setTimeout(tick, interval());
  }

  async function fetchText(url) {
    const response = await fetch(url, { credentials: "same-origin", cache: "no-store" });
    if (!response.ok) throw new Error(url + ": " + response.status);
    return response.text();
  }

  function refreshing(boxId, url, ms) {
    const box = document.getElementById(boxId);
    if (!box) return;
    every(() => ms, async () => {
      const html = await fetchText(url());
      if (html !== box.dataset.shown) {
        box.innerHTML = html;
        box.dataset.shown = html;
      }
    });
  }

  if (page === "runs") {
    refreshing("runs-live", () => "/runs/table" + location.search, 2000);
  }
  if (page === "scheduler") {
    refreshing("scheduler-live", () => "/scheduler/table", 3000);
  }
  if (page === "run") {
    runPage(document.getElementById("run"));
  }

  function runPage(root) {
    const runId = root.dataset.runId;
    const base = "/runs/" + encodeURIComponent(runId);
    let filter = null; // {kind: "state" | "edge", value}

    function matches(el) {
      if (!filter) return true;
      if (filter.kind === "edge") return el.dataset.edge === filter.value;
      return (el.dataset.states || "").split(" ").includes(filter.value);
    }

    function applyFilter() {
      for (const el of root.querySelectorAll("#run-timeline .entry")) {
        el.hidden = !matches(el);
      }
      for (const section of root.querySelectorAll("#run-timeline section.iteration")) {
        section.hidden = !section.querySelector(".entry:not([hidden])");
      }
      for (const g of root.querySelectorAll("#diagram .selected")) g.classList.remove("selected");
      const bar = document.getElementById("filterbar");
      bar.hidden = !filter;
      if (filter) {
        const attr = filter.kind === "edge" ? "data-edge" : "data-state";
        for (const g of root.querySelectorAll("#diagram [" + attr + "]")) {
          if (g.getAttribute(attr) === filter.value) g.classList.add("selected");
        }
        document.getElementById("filter-label").textContent =
          (filter.kind === "edge" ? "edge " : "state ") + filter.value.replace("->", " → ");
      }
    }

    root.addEventListener("click", (event) => {
      const target = event.target.closest("#diagram [data-state], #diagram [data-edge]");
      if (!target) return;
      const next = target.dataset.state !== undefined
        ? { kind: "state", value: target.dataset.state }
        : { kind: "edge", value: target.dataset.edge };
      const same = filter && filter.kind === next.kind && filter.value === next.value;
      filter = same ? null : next;
      applyFilter();
    });
    document.getElementById("filter-clear").addEventListener("click", () => {
      filter = null;
      applyFilter();
    });

    async function refresh() {
      const head = JSON.parse(await fetchText(base + "/head"));
      if (String(head.seq) === root.dataset.seq) return;
      const fresh = JSON.parse(await fetchText(base + "/parts"));
      const open = new Set(
        Array.from(root.querySelectorAll("details[open]"), (d) => d.dataset.key)
      );
      for (const [name, html] of Object.entries(fresh.parts)) {
        const box = document.getElementById("run-" + name);
        if (box) box.innerHTML = html;
      }
      for (const details of root.querySelectorAll("details[data-key]")) {
        if (open.has(details.dataset.key)) details.open = true;
      }
      root.dataset.seq = String(fresh.seq);
      root.dataset.status = fresh.status;
      root.dataset.live = fresh.live ? "yes" : "no";
      applyFilter();
    }

    every(() => (root.dataset.live === "yes" ? 1000 : 5000), refresh);
  }
})();
