/* The usage page's charts: GPU-hours per day, stacked, from the JSON the page carries
   (<script id="usage-data" type="application/json">). Stacking is drawn, not computed by uPlot:
   each series is the running sum of those below it, drawn from the top down, so each bar shows
   its own share. */
(() => {
  const COLOURS = ["#2f5fd0", "#1f8a4c", "#b7791f", "#c0392b", "#7b3fb5", "#138d90", "#d35400",
                   "#566573", "#a93279", "#5d8a1f", "#2c3e50", "#9a7d0a", "#888888"];

  function stacked(box, days, groups) {
    const names = Object.keys(groups);
    if (!names.length) { box.innerHTML = '<p class="muted">No finished jobs in this period.</p>'; return; }
    const x = days.map((d) => Date.parse(d + "T00:00:00Z") / 1000);
    const running = days.map(() => 0);
    const sums = names.map((name) => days.map((d, i) => (running[i] += groups[name][d] || 0)));
    const own = names.map((name) => days.map((d) => groups[name][d] || 0));
    const order = names.map((_, i) => names.length - 1 - i);  // the top of the stack first
    const bars = uPlot.paths.bars({size: [0.8, 40]});
    const series = [{}].concat(order.map((i) => ({
      label: names[i],
      stroke: COLOURS[i % COLOURS.length],
      fill: COLOURS[i % COLOURS.length],
      paths: bars,
      value: (u, v, s, idx) => (idx == null ? "" : own[i][idx].toFixed(1) + " GPU-h"),
    })));
    const width = Math.max(Math.min(box.clientWidth || 900, 1100), 340);
    new uPlot({width, height: 260, series, axes: [{}, {size: 50, label: "GPU-hours"}],
               scales: {x: {time: true}}, cursor: {points: {show: false}}},
              [x, ...order.map((i) => sums[i])], box);
  }

  document.addEventListener("DOMContentLoaded", () => {
    const holder = document.getElementById("usage-data");
    if (!holder || typeof uPlot === "undefined") return;
    const data = JSON.parse(holder.textContent);
    stacked(document.getElementById("usage-by-group"), data.days, data.byGroup);
    stacked(document.getElementById("usage-by-model"), data.days, data.byModel);
  });
})();
