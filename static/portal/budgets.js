/* The budgets page: one burn-down chart per budget, drawn with uPlot from the json_script
   block the page carries (no inline script: the Content-Security-Policy allows only this
   origin's files). Left = the limit less what was used by the end of each day; ideal = an even spend. */
"use strict";
(() => {
  const day = 86400;
  function draw(box) {
    const source = document.getElementById(box.dataset.burndown);
    if (!source || typeof uPlot === "undefined") return;
    const s = JSON.parse(source.textContent);
    if (!s.t.length) { box.textContent = "No usage recorded in this window yet."; return; }
    const one = (title, series, data) => {
      const div = document.createElement("div");
      box.appendChild(div);
      const scales = {x: {time: true}, y: {range: (u, min, max) => [0, Math.max(max, 1)]}};
      new uPlot({title, width: 420, height: 200, series: [{}, ...series], axes: [{}, {size: 50}], scales}, [s.t, ...data], div);
    };
    one("Burn-down: GPU-hours not yet used", [
      {label: "left", stroke: "#2f5fd0", width: 2, fill: "#2f5fd022"},
      {label: "ideal", stroke: "#8a94a6", width: 1, dash: [6, 4]},
    ], [s.left, s.ideal]);
    one("GPU-hours used per day", [
      {label: "used", stroke: "#1f8a4c", width: 2, fill: "#1f8a4c22", paths: uPlot.paths && uPlot.paths.bars ? uPlot.paths.bars({size: [0.6, 100]}) : undefined},
    ], [s.daily]);
  }
  document.addEventListener("DOMContentLoaded", () => {
    if (document.body.dataset.page !== "budgets") return;
    document.querySelectorAll("[data-burndown]").forEach(draw);
  });
})();
