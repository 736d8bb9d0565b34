// Sluice's own small line chart: an SVG per chart, a rolling window of points per series.
// No dependencies and no build step; what the operator page needs and nothing more.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563"];

function svgEl(name, attrs, parent) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

function shortNumber(v) {
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
  return a >= 10 || v === 0 ? v.toFixed(0) : v.toFixed(2);
}

class LineChart {
  // container: an element; opts: {title, unit, window (points kept)}
  constructor(container, opts) {
    this.opts = Object.assign({unit: "", window: 150}, opts);
    this.series = new Map();  // name -> [{t, v}]
    this.box = document.createElement("figure");
    this.box.className = "chart";
    const caption = document.createElement("figcaption");
    caption.textContent = this.opts.title;
    this.box.appendChild(caption);
    this.svg = svgEl("svg", {viewBox: "0 0 480 200", role: "img", "aria-label": this.opts.title}, this.box);
    this.legend = document.createElement("div");
    this.legend.className = "legend";
    this.box.appendChild(this.legend);
    container.appendChild(this.box);
  }

  push(t, values) {  // values: {seriesName: number}
    for (const [name, v] of Object.entries(values)) {
      if (v === null || v === undefined || !isFinite(v)) continue;
      if (!this.series.has(name)) this.series.set(name, []);
      const points = this.series.get(name);
      points.push({t, v});
      if (points.length > this.opts.window) points.shift();
    }
    this.render();
  }

  render() {
    const W = 480, H = 200, L = 44, R = 8, T = 8, B = 22;
    while (this.svg.firstChild) this.svg.removeChild(this.svg.firstChild);
    const all = [...this.series.values()].flat();
    this.box.dataset.points = String(all.length);
    if (!all.length) {
      svgEl("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"}, this.svg).textContent = "no data yet";
      return;
    }
    const t0 = Math.min(...all.map(p => p.t)), t1 = Math.max(...all.map(p => p.t), t0 + 1);
    const top = Math.max(...all.map(p => p.v));
    const vmax = top > 0 ? top * 1.1 : 1;  // an all-zero series sits on the axis of a 0-1 chart
    const x = t => L + (t - t0) / (t1 - t0) * (W - L - R);
    const y = v => H - B - v / vmax * (H - T - B);
    for (const f of [0, 0.5, 1]) {
      svgEl("line", {x1: L, x2: W - R, y1: y(vmax * f), y2: y(vmax * f), class: "grid"}, this.svg);
      svgEl("text", {x: L - 4, y: y(vmax * f) + 4, "text-anchor": "end", class: "axis"}, this.svg)
        .textContent = shortNumber(vmax * f);
    }
    svgEl("text", {x: W - R, y: H - 6, "text-anchor": "end", class: "axis"}, this.svg)
      .textContent = `last ${Math.round(t1 - t0)} s`;
    this.legend.textContent = "";
    [...this.series.entries()].forEach(([name, points], i) => {
      const colour = COLOURS[i % COLOURS.length];
      svgEl("polyline", {points: points.map(p => `${x(p.t).toFixed(1)},${y(p.v).toFixed(1)}`).join(" "),
                         stroke: colour, class: "series", "data-series": name}, this.svg);
      const item = document.createElement("span");
      item.style.color = colour;
      item.textContent = `${name}: ${shortNumber(points[points.length - 1].v)}${this.opts.unit}`;
      this.legend.appendChild(item);
    });
  }
}

window.LineChart = LineChart;
