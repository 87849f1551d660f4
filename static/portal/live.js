/* Orrery portal: live pages over one websocket each, resynchronised from REST on reconnect.
   No page carries inline script (the Content-Security-Policy allows only this origin's files):
   <body data-page> names the page's initialiser, which reads its parameters from data
   attributes and json_script blocks, and colours are set through element.style, never as
   style="…" markup. */
"use strict";
const Orrery = (() => {
  const csrf = () => document.body.dataset.csrf;
  const $ = (sel, root = document) => root.querySelector(sel);
  const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));

  async function api(method, path, body, type = "application/json") {
    const init = {method, headers: {"X-CSRFToken": csrf(), Accept: "application/json"}, credentials: "same-origin"};
    if (body !== undefined) {
      init.headers["Content-Type"] = type;
      init.body = type === "application/json" ? JSON.stringify(body) : body;
    }
    const response = await fetch(path, init);
    let data = null;
    try { data = await response.json(); } catch (e) { data = null; }
    return {ok: response.ok, status: response.status, data};
  }

  /* One websocket with reconnect (1 s, doubling to 15 s) and a resync callback after each
     (re)connection, so nothing missed while it was down stays missed. */
  function socket(path, onDelta, onResync) {
    const dot = $("#live");
    let wait = 1000;
    const open = () => {
      const ws = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + path);
      ws.onopen = () => { wait = 1000; if (dot) dot.className = "live on"; if (onResync) onResync(); };
      ws.onmessage = (m) => { const msg = JSON.parse(m.data); if (msg.type === "delta") onDelta(msg); };
      ws.onclose = (e) => {
        if (dot) dot.className = "live off";
        if (e.code === 4401 || e.code === 4404) return;
        setTimeout(open, wait);
        wait = Math.min(wait * 2, 15000);
      };
    };
    open();
  }

  /* Times as the server renders them, in the server's zone (<body data-tz>): one format on a
     page whether a line came with it or arrived live. */
  const parts = (iso, options) => {
    const format = new Intl.DateTimeFormat("en-US", {timeZone: document.body.dataset.tz || "UTC", hourCycle: "h23", ...options});
    return Object.fromEntries(format.formatToParts(new Date(iso)).map((p) => [p.type, p.value]));
  };
  /* "2026-12-02 14:20:05", as Django's "Y-m-d H:i:s". */
  const stamp = (iso) => {
    const p = parts(iso, {year: "numeric", month: "2-digit", day: "2-digit", hour: "2-digit", minute: "2-digit", second: "2-digit"});
    return `${p.year}-${p.month}-${p.day} ${p.hour}:${p.minute}:${p.second}`;
  };
  /* "14:20 UTC" today, "Dec 3, 14:20 UTC" another day: the server's start_estimate. */
  const shortWhen = (iso) => {
    const p = parts(iso, {month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", timeZoneName: "short"});
    const today = parts(new Date().toISOString(), {month: "short", day: "numeric", year: "numeric"});
    const day = parts(iso, {month: "short", day: "numeric", year: "numeric"});
    const same = day.year === today.year && day.month === today.month && day.day === today.day;
    return `${same ? "" : `${p.month} ${p.day}, `}${p.hour}:${p.minute} ${p.timeZoneName}`;
  };
  /* Time used as the server's clock_text: "0:42", "2:30:00", "1-02:00:00". */
  const clock = (seconds) => {
    const s = Math.max(Math.floor(seconds), 0), pad = (n) => String(n).padStart(2, "0");
    const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60), sec = s % 60;
    if (d) return `${d}-${pad(h)}:${pad(m)}:${pad(sec)}`;
    return h ? `${h}:${pad(m)}:${pad(sec)}` : `${m}:${pad(sec)}`;
  };

  function setState(el, state) {
    if (!el) return;
    el.textContent = state;
    el.className = el.className.replace(/job-[A-Z]+/, "job-" + state);
  }

  /* A job list (the jobs page, the dashboard) kept current: a change heard on the websocket
     recolours the job's state at once, then the rows on the page are read again from the
     server (at most once a second), cell by cell, so cluster, reason, expected start and array
     counts are the server's own rendering and a ticked checkbox stays ticked. Running jobs'
     time used ticks every second. */
  function liveJobs(path) {
    let pending = null;
    const refreshRows = () => {
      if (pending) return;
      pending = setTimeout(async () => {
        const r = await fetch(location.href, {credentials: "same-origin", headers: {Accept: "text/html"}});
        pending = null;
        if (!r.ok) return;
        const fresh = new DOMParser().parseFromString(await r.text(), "text/html");
        document.querySelectorAll("tr[data-row]").forEach((row) => {
          const now = fresh.querySelector(`tr[data-row="${row.dataset.row}"]`);
          if (!now) return;
          row.querySelectorAll("[data-cell]").forEach((cell) => {
            const next = now.querySelector(`[data-cell="${cell.dataset.cell}"]`);
            if (next) cell.replaceWith(document.importNode(next, true));
          });
        });
        tick();
      }, 1000);
    };
    const tick = () => {
      document.querySelectorAll("td[data-started]").forEach((cell) => {
        cell.textContent = clock(Date.now() / 1000 - Number(cell.dataset.started));  // epoch seconds
      });
    };
    setInterval(() => { if (!document.hidden) tick(); }, 1000);
    let first = true;
    socket(path, (delta) => {
      for (const [id, state] of Object.entries(delta.jobs)) {
        document.querySelectorAll(`tr[data-job="${id}"] [data-state]`).forEach((el) => setState(el, state));
      }
      if (Object.keys(delta.jobs).length) refreshRows();
      if (delta.newJobs) {
        let note = $("#new-jobs");
        if (!note) {
          note = document.createElement("p");
          note.id = "new-jobs";
          note.className = "flash";
          $("main").prepend(note);
        }
        note.dataset.n = String(Number(note.dataset.n || 0) + delta.newJobs);
        note.innerHTML = `${note.dataset.n} new job(s). <a href="${location.pathname + location.search}">Show them</a>`;
      }
    }, () => { if (!first) refreshRows(); first = false; });
  }

  function jobsPage() {
    // Delegated: filtering, sorting and paging swap the table in place (htmx), listeners stay.
    document.addEventListener("change", (e) => {
      if (e.target.id === "all") document.querySelectorAll('input[name="job"]').forEach((c) => { c.checked = e.target.checked; });
    });
    liveJobs("/ws/jobs/");
  }

  function jobPage(id) {
    const ACTIONS = JSON.parse($("#action-sources").textContent);  // the server's own table
    // What the output box says while there is no output, by where the job is in its life.
    const NOTES = JSON.parse($("#output-notes").textContent), PHASES = JSON.parse($("#output-phases").textContent);
    let shown = false;  // output lines are on the page
    const box = $("#job-actions");
    const allowed = [...box.querySelectorAll("button")].length > 0 || box.dataset.allowed === "1";
    box.dataset.allowed = allowed ? "1" : "0";
    const render = (job) => {
      setState($("#job-state"), job.state);
      const why = $("#job-why");
      why.textContent = job.reasonMessage || "";
      why.hidden = !job.reasonMessage;
      const estimate = $("#job-estimate");
      const start = job.estimatedStart;
      estimate.textContent = start
        ? `Would start ≈ ${shortWhen(start.at)}${start.where ? ` on ${start.where}` : ""} — ${start.reserved ? "reserved" : "an estimate, not a reservation"}`
        : "";
      if (!shown) $("#log").textContent = NOTES[PHASES[job.state]] || "";
      estimate.hidden = !start;
      if (allowed) {
        box.innerHTML = Object.keys(ACTIONS).filter((a) => ACTIONS[a].includes(job.state))
          .map((a) => `<button type="button" data-action="${a}" class="${a === "cancel" ? "danger" : ""}">${a[0].toUpperCase() + a.slice(1)}</button>`).join("");
      }
      const p = job.placement;
      const place = $("#placement");
      if (p && place) {
        place.outerHTML = `<dl class="facts" id="placement"><dt>Cluster</dt><dd>${esc(p.cluster)} (attempt ${p.attempt}${p.active ? "" : ", ended"})</dd>` +
          p.nodes.map((n) => `<dt>${esc(n.node)}</dt><dd>GPUs ${n.gpus.join(", ") || "—"}</dd>`).join("") + "</dl>";
      }
    };
    const refresh = async () => {
      const [job, events] = await Promise.all([api("GET", `/api/v1/jobs/${id}`), api("GET", `/api/v1/jobs/${id}/events`)]);
      if (job.ok) render(job.data);
      if (events.ok) {
        const items = events.data.results || events.data;
        $("#timeline").innerHTML = items.slice().sort((a, b) => a.id - b.id).map((e) =>
          `<li><time>${esc(stamp(e.at))}</time> ${e.toState ? `<span class="state job-${esc(e.toState)}">${esc(e.toState)}</span>` : ""} ${esc(e.message)}${e.actor ? ` <span class="muted">(${esc(e.actor)})</span>` : ""}</li>`).join("");
      }
    };
    const tail = async () => {
      const r = await api("GET", `/api/v1/jobs/${id}/logs?tail=200`);
      if (r.ok && r.data.lines.length) {
        shown = true;
        const log = $("#log");
        const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
        log.textContent = r.data.lines.join("\n");
        if (atBottom) log.scrollTop = log.scrollHeight;
      }
    };
    box.addEventListener("click", async (e) => {
      const action = e.target.dataset.action;
      if (!action) return;
      e.target.disabled = true;
      const r = await api("POST", `/api/v1/jobs/${id}/${action}`);
      if (r.ok) render(r.data); else alert((r.data && r.data.detail) || `${action} failed (${r.status})`);
      refresh();
    });
    let first = true;
    socket(`/ws/jobs/${id}/`, () => { refresh(); tail(); }, () => { if (!first) refresh(); first = false; });
    tail();
    setInterval(() => { if (!document.hidden) tail(); }, 2000);
  }

  function showErrors(list) {
    const ul = $("#errors");
    ul.innerHTML = list.map((e) => `<li><code>${esc(e.path)}</code> ${esc(e.message)}</li>`).join("");
    ul.hidden = !list.length;
  }

  function submitPage() {
    document.querySelectorAll(".tabs button").forEach((b) => b.addEventListener("click", () => {
      document.querySelectorAll(".tabs button").forEach((x) => x.classList.toggle("on", x === b));
      document.querySelectorAll("[data-pane]").forEach((p) => { p.hidden = p.dataset.pane !== b.dataset.tab; });
      showErrors([]);
    }));
    const done = (r) => {
      if (r.ok) { location.href = `/jobs/${r.data.id}/`; return; }
      showErrors((r.data && r.data.errors) || [{path: "(request)", message: (r.data && r.data.detail) || `error ${r.status}`}]);
    };
    $("#submit-form").addEventListener("submit", async (e) => {
      e.preventDefault();
      const f = new FormData(e.target);
      const [project, queue] = f.get("queue").split("/");
      const gpus = Number(f.get("gpus") || 0);
      const spec = {
        // No model chosen: GPUs of any model (the scheduler picks one when it places the job).
        resources: {gpus: gpus && f.get("model") ? `${f.get("model")}:${gpus}` : gpus, nodes: Number(f.get("nodes") || 1)},
        queue, run: f.get("run"),
      };
      if (f.get("timeLimit")) spec.timeLimit = f.get("timeLimit");
      if (f.get("cluster")) spec.placement = {clusters: [f.get("cluster")]};
      done(await api("POST", "/api/v1/jobs", {apiVersion: "orrery/v1", kind: "Job", metadata: {name: f.get("name"), project}, spec}));
    });
    $("#submit-yaml").addEventListener("submit", async (e) => {
      e.preventDefault();
      done(await api("POST", "/api/v1/jobs", new FormData(e.target).get("yaml"), "application/yaml"));
    });
  }

  /* The heatmap: one cell per node on a canvas (10,000 cells draw in a few ms). */
  const STATE_COLOURS = {
    ready: "#2e9e5b", not_ready: "#e0a030", down: "#c0392b", draining: "#6b8fd6",
    drained: "#4a5a7a", cordoned: "#9aa5b8", unknown: "#cccccc",
  };
  const ramp = (x) => (x === null || x === undefined) ? "#d9dee7" : `hsl(${220 - 220 * Math.min(Math.max(x, 0), 1)}, 70%, ${60 - 15 * x}%)`;

  function fleetPage(opts) {
    const canvas = $("#heatmap");
    const ctx = canvas.getContext("2d");
    const tip = $("#tip");
    let data = null, index = new Map(), cell = 10, cols = 1;
    const colour = (i) => {
      const mode = $("#colour").value;
      if (mode === "util") return ramp(data.util[i] === null ? null : data.util[i] / 100);
      if (mode === "alloc") return ramp(data.gpus[i] ? data.held[i] / data.gpus[i] : null);
      return STATE_COLOURS[data.state[i]] || STATE_COLOURS.unknown;
    };
    const drawCell = (i) => {
      ctx.fillStyle = colour(i);
      ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell - 1, cell - 1);
    };
    const draw = () => {
      const n = data.id.length;
      cell = n > 5000 ? 8 : n > 1000 ? 12 : n > 100 ? 18 : 28;
      cols = Math.max(1, Math.floor(canvas.width / cell));
      canvas.height = Math.max(cell, Math.ceil(n / cols) * cell);
      canvas.dataset.nodes = String(n);
      ctx.clearRect(0, 0, canvas.width, canvas.height);
      for (let i = 0; i < n; i++) drawCell(i);
      $("#count").textContent = `${n} nodes`;
      const mode = $("#colour").value;
      legend(mode === "state" ? Object.entries(STATE_COLOURS) : [["0 %", ramp(0)], ["50 %", ramp(0.5)], ["100 %", ramp(1)]]);
    };
    const legend = (entries) => {
      const box = $("#legend");
      box.replaceChildren();
      for (const [label, c] of entries) {
        const swatch = document.createElement("i");
        swatch.style.background = c;
        box.append(swatch, `${label} `);
      }
    };
    const load = async () => {
      const r = await fetch("/fleet/nodes.json" + (opts.cluster ? `?cluster=${encodeURIComponent(opts.cluster)}` : ""), {credentials: "same-origin"});
      data = await r.json();
      index = new Map(data.id.map((id, i) => [id, i]));
      draw();
    };
    canvas.addEventListener("mousemove", (e) => {
      if (!data) return;
      const rect = canvas.getBoundingClientRect();
      const x = (e.clientX - rect.left) * canvas.width / rect.width, y = (e.clientY - rect.top) * canvas.height / rect.height;
      const i = Math.floor(y / cell) * cols + Math.floor(x / cell);
      if (x >= cols * cell || i >= data.id.length) { tip.hidden = true; return; }
      tip.hidden = false;
      tip.style.left = `${e.clientX - rect.left + 12}px`;
      tip.style.top = `${e.clientY - rect.top + 12}px`;
      tip.innerHTML = `<strong>${esc(data.name[i])}</strong> · ${esc(data.cluster[i])}<br>${esc(data.state[i])} · GPUs ${data.held[i]}/${data.gpus[i]} held` +
        (data.util[i] === null ? "" : ` · ${data.util[i]} % busy`);
      tip.dataset.node = data.name[i];
    });
    canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
    /* The colour drawn for a node, read back from the canvas (for checks and for support). */
    cellColour = (name) => {
      const i = data ? data.name.indexOf(name) : -1;
      if (i < 0) return null;
      const p = ctx.getImageData((i % cols) * cell + 1, Math.floor(i / cols) * cell + 1, 1, 1).data;
      return `rgb(${p[0]}, ${p[1]}, ${p[2]})`;
    };
    $("#colour").addEventListener("change", draw);
    let first = true;
    socket(opts.cluster ? `/ws/clusters/${encodeURIComponent(opts.cluster)}/` : "/ws/fleet/", (delta) => {
      if (!data) return;
      for (const [id, state] of Object.entries(delta.nodes)) {
        const i = index.get(Number(id));
        if (i !== undefined) { data.state[i] = state; drawCell(i); }
      }
    }, () => { if (!first) load(); first = false; });
    load();
    setInterval(() => { if (!document.hidden) load(); }, 30000);
    charts(opts.cluster);
  }

  async function charts(cluster) {
    const box = $("#charts");
    if (!box || typeof uPlot === "undefined") return;
    const r = await fetch("/fleet/series.json" + (cluster ? `?cluster=${encodeURIComponent(cluster)}` : ""), {credentials: "same-origin"});
    const s = await r.json();
    if (!s.t.length) { box.innerHTML = '<p class="muted">No roll-ups yet: they appear a minute after the first heartbeats.</p>'; return; }
    const one = (title, values, label, colour) => {
      const div = document.createElement("div");
      box.appendChild(div);
      new uPlot({title, width: 340, height: 180, series: [{}, {label, stroke: colour, width: 2, fill: colour + "22"}], axes: [{}, {size: 40}]}, [s.t, values], div);
    };
    one("GPUs allocated (%)", s.allocated, "allocated %", "#2f5fd0");
    one("GPU utilisation (%)", s.utilisation, "busy %", "#1f8a4c");
    one("Power (kW)", s.power_kw, "kW", "#b7791f");
  }

  let cellColour = () => null;

  /* <body data-page="…"> → the page's initialiser, its parameters read from the page itself. */
  const PAGES = {
    dashboard: () => liveJobs("/ws/jobs/"),
    jobs: jobsPage,
    job: () => jobPage(Number($("#job-actions").dataset.job)),
    submit: submitPage,
    fleet: () => fleetPage({cluster: $("#heatmap").dataset.cluster}),
  };
  document.addEventListener("DOMContentLoaded", () => {
    const init = PAGES[document.body.dataset.page];
    if (init) init();
  });

  return {api, socket, liveJobs, jobsPage, jobPage, submitPage, fleetPage, cellColour: (name) => cellColour(name)};
})();
