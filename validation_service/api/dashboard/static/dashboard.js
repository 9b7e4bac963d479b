/* ckval dashboard: draws the page's embedded JSON, then keeps it fresh by polling the
   same JSON every 2 s while validations are queued or running (every 15 s otherwise).
   Plain browser JavaScript and uPlot; no build step. */
(function () {
  "use strict";

  const FAST_POLL_MS = 2000;
  const SLOW_POLL_MS = 15000;
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2",
    "#ca8a04", "#db2777", "#4b5563", "#65a30d"];

  // Report indexes are whole numbers: ticks at 1, 2, 5, 10, 20, ... reports apart.
  const REPORT_TICKS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 100000];
  const base = document.body.dataset.base || "/ui";
  const dataNode = document.getElementById("ckval-data");
  const ckval = (window.ckval = {
    plots: {}, data: dataNode ? JSON.parse(dataNode.textContent) : null, refreshes: 0,
  });

  // ------------------------------------------------------------------ helpers
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      // Through the CSSOM: a style attribute is inline CSS, which the page's
      // Content-Security-Policy (style-src 'self') refuses.
      else if (key === "style") node.style.cssText = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function svg(tag, attrs, ...children) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    for (const child of children) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function fmt(value) {
    if (value === null || value === undefined) return "–";
    if (typeof value !== "number") return String(value);
    if (Number.isInteger(value)) return String(value);
    const size = Math.abs(value);
    if (size !== 0 && (size >= 1e5 || size < 1e-3)) return value.toExponential(3);
    return String(Number(value.toPrecision(5)));
  }

  function seconds(from, to) {
    return (Date.parse(to) - Date.parse(from)) / 1000;
  }

  function took(s) {
    if (s === null || Number.isNaN(s)) return "–";
    if (s < 1) return `${Math.round(s * 1000)} ms`;
    if (s < 120) return `${s.toFixed(1)} s`;
    if (s < 7200) return `${(s / 60).toFixed(1)} min`;
    return `${(s / 3600).toFixed(1)} h`;
  }

  function ago(iso) {
    if (!iso) return "–";
    return `${took(Math.max(0, (Date.now() - Date.parse(iso)) / 1000))} ago`;
  }

  function size(bytes) {
    let n = bytes;
    for (const unit of ["B", "KB", "MB", "GB"]) {
      if (n < 1024 || unit === "GB") return unit === "B" ? `${n} B` : `${n.toFixed(1)} ${unit}`;
      n /= 1024;
    }
    return String(bytes);
  }

  function status(value) {
    return el("span", { class: `status ${value}` }, value);
  }

  function replaceRows(table, rows) {
    const body = table.tBodies[0];
    body.replaceChildren(...rows);
  }

  function plotWidth(container) {
    return Math.max(320, Math.floor(container.clientWidth || 440) - 16);
  }

  // Polls url while the page is open: every 2 s when jobs are queued or running.
  function keepFresh(url, apply) {
    const live = document.getElementById("live");
    let current = ckval.data;
    const schedule = () => {
      const active = current && current.active_jobs > 0;
      if (live) live.classList.toggle("on", Boolean(active));
      setTimeout(refresh, active ? FAST_POLL_MS : SLOW_POLL_MS);
    };
    const refresh = async () => {
      try {
        const response = await fetch(url(), {
          headers: { Accept: "application/json" }, credentials: "same-origin",
        });
        if (response.ok) {
          current = ckval.data = await response.json();
          apply(current);
          ckval.refreshes += 1;
        }
      } catch (error) {
        console.warn("ckval: refresh failed", error);
      }
      schedule();
    };
    ckval.refreshNow = refresh;
    schedule();
  }

  // --------------------------------------------------------------- runs page
  function runsPage(table) {
    const metricSelect = document.getElementById("metric");
    const modeSelect = document.getElementById("mode");
    const compareButton = document.getElementById("compare");
    const checked = new Set();
    const params = new URLSearchParams(location.search);

    function query() {
      const q = new URLSearchParams();
      for (const key of ["page", "per_page", "metric", "mode"]) {
        if (params.get(key)) q.set(key, params.get(key));
      }
      return q.toString();
    }

    function draw(data) {
      const names = data.metrics.includes(data.metric) || !data.metric
        ? data.metrics : [data.metric, ...data.metrics];
      metricSelect.replaceChildren(
        ...names.map((name) => el("option", { value: name, selected: name === data.metric }, name)));
      modeSelect.value = data.mode;
      document.getElementById("best-head").textContent =
        data.metric ? `best ${data.metric} (${data.mode})` : "best";
      const rows = data.runs.map((run) => el("tr", { "data-run": run.name },
        el("td", {}, el("input", {
          type: "checkbox", value: run.name, checked: checked.has(run.name),
          onchange: (event) => {
            if (event.target.checked) checked.add(run.name); else checked.delete(run.name);
            compareButton.disabled = checked.size === 0;
          },
        })),
        el("td", {}, el("a", { href: run.url }, run.name)),
        el("td", {}, run.namespace),
        el("td", {}, status(run.status)),
        el("td", { class: "num" }, run.checkpoints),
        el("td", { class: "num" }, run.validated),
        el("td", { class: "num" }, run.queued),
        el("td", { class: "num" },
          run.waiting ? `${run.running} (+${run.waiting} waiting)` : run.running),
        el("td", { class: "num" }, run.failed),
        el("td", { class: "num best" }, fmt(run.best)),
        el("td", { title: run.last_activity }, ago(run.last_activity)),
      ));
      if (!rows.length) {
        rows.push(el("tr", {}, el("td", { colspan: 11, class: "empty" },
          "No runs yet: report a checkpoint with trainer_integration.report().")));
      }
      replaceRows(table, rows);
      const pages = document.getElementById("pages");
      const links = [];
      for (let n = 1; n <= data.pages; n++) {
        if (n === data.page) { links.push(el("span", {}, `page ${n}`)); continue; }
        const q = new URLSearchParams(query());
        q.set("page", n);
        links.push(el("a", { href: `?${q}` }, n));
      }
      pages.replaceChildren(el("span", {}, `${data.total} runs`), ...(data.pages > 1 ? links : []));
    }

    function choose() {
      history.replaceState(null, "", `?${query()}`);
      ckval.refreshNow();
    }
    metricSelect.addEventListener("change", () => {
      // Another metric ranks in its own usual direction until a mode is chosen.
      params.set("metric", metricSelect.value);
      params.delete("mode");
      choose();
    });
    modeSelect.addEventListener("change", () => {
      params.set("mode", modeSelect.value);
      choose();
    });
    compareButton.addEventListener("click", () => {
      const q = new URLSearchParams({ runs: [...checked].join(",") });
      if (metricSelect.value) q.set("metric", metricSelect.value);
      location.href = `${base}/compare?${q}`;
    });
    draw(ckval.data);
    keepFresh(() => `${base}/api/runs?${query()}`, draw);
  }

  // ----------------------------------------------------------------- run page
  // The named validators a plot draws beside report()'s own: the one picked, or all.
  function drawnValidators(series) {
    const picked = ckval.validator;
    return Object.keys(series.validators || {}).filter((v) => !picked || v === picked);
  }

  function metricPlot(container, name, series) {
    const box = el("div", { class: "plot", "data-metric": name });
    const named = drawnValidators(series);
    box.dataset.validators = named.join(",");
    const title = el("h3", {}, name, " ", el("span", { class: "best" }));
    box.append(title);
    container.append(box);
    const options = {
      width: plotWidth(box),
      height: 240,
      scales: { x: { time: false } },
      axes: [{ label: "report index", incrs: REPORT_TICKS }, {}],
      hooks: { draw: [drawStopMarker] },
      series: [
        { label: "report" },
        { label: "reported", stroke: "#94a3b8", width: 1.5, spanGaps: true,
          points: { show: true, size: 5 } },
        { label: "validated", stroke: COLORS[0], width: 2, spanGaps: true,
          points: { show: true, size: 6 } },
        ...named.map((validator, i) => ({
          label: `validated (${validator})`, stroke: COLORS[(i + 2) % COLORS.length], width: 2,
          dash: [6, 3], spanGaps: true, points: { show: true, size: 6 } })),
        { label: "best", stroke: "#dc2626", width: 0, paths: () => null,
          points: { show: true, size: 13, width: 2, stroke: "#dc2626", fill: "transparent" } },
      ],
    };
    const plot = new uPlot(options, plotData(series), box);
    plot.titleNode = title.querySelector(".best");
    return plot;
  }

  // The run's stop decision on every plot: a dashed line at the deciding report, labelled
  // with the rule, the values that decided and the override. Redrawn with the plot (uPlot's
  // draw hook), from the page's latest data.
  function drawStopMarker(plot) {
    const decision = ckval.data && ckval.data.stop_decision;
    let marker = plot.over.querySelector(".stop-marker");
    if (!decision) {
      if (marker) marker.remove();
      return;
    }
    if (!marker) {
      marker = el("div", { class: "stop-marker" }, el("span", { class: "stop-rule" }),
        el("span", { class: "stop-values" }));
      plot.over.append(marker);
    }
    const left = plot.valToPos(decision.report_index, "x");
    const right = left > plot.over.clientWidth / 2;
    const color = decision.stopped ? "#ea580c" : "#6b7280";
    marker.dataset.reportIndex = decision.report_index;
    marker.dataset.rule = decision.rule;
    marker.dataset.stopped = decision.stopped;
    marker.title = stopText(decision);
    marker.style.cssText = `position:absolute;top:0;bottom:0;left:${left}px;width:0;` +
      `border-left:2px dashed ${color};pointer-events:auto;z-index:5;` +
      (left < 0 || left > plot.over.clientWidth ? "display:none;" : "");
    const [rule, values] = marker.children;
    rule.textContent = `stop: ${decision.rule} at report ${decision.report_index}` +
      (decision.stopped ? "" : ` · overridden, resumed after report ${decision.resumed_after_index}`);
    values.textContent = stopValues(decision);
    const side = right ? "right:4px;text-align:right;" : "left:4px;";
    const label = `position:absolute;${side}font-size:11px;line-height:1.25;color:${color};` +
      "background:rgba(255,255,255,.85);padding:0 3px;white-space:nowrap;";
    rule.style.cssText = `${label}top:2px;font-weight:600;`;
    values.style.cssText = `${label}top:16px;`;
  }

  function stopValues(decision) {
    const metric = decision.policy ? `${decision.policy.metric} ` : "";
    const values = decision.values.map((v) => `${fmt(v.value)} (report ${v.report_index})`);
    const compared = { threshold: "target", median_of_runs: "median" }[decision.rule] || "best";
    const reference = decision.reference === null ? "" : `; ${compared} ${fmt(decision.reference)}`;
    return `${metric}${values.join(", ")}${reference}`;
  }

  function stopText(decision) {
    let text = `${decision.reason} (decided ${decision.decided_at})`;
    if (!decision.stopped) {
      text += `; overridden ${decision.overridden_at}, training resumed after report ` +
        `${decision.resumed_after_index}`;
    }
    return text;
  }

  function plotData(series) {
    const best = series.x.map((index) =>
      series.best && index === series.best.report_index ? series.best.value : null);
    const named = drawnValidators(series).map((v) => series.validators[v]);
    return [series.x, series.reported, series.validated, ...named, best];
  }

  function runPage(run) {
    const plots = document.getElementById("plots");
    const openErrors = new Set();
    const params = new URLSearchParams(location.search);
    const picker = document.getElementById("metric-choice");
    let pickerNames = null;

    function drawPlots(data) {
      const names = Object.keys(data.series);
      for (const [name, plot] of Object.entries(ckval.plots)) {
        if (names.includes(name)) continue;  // another choice of metrics: drop the others
        const box = plot.root.parentNode;
        plot.destroy();
        box.remove();
        delete ckval.plots[name];
      }
      if (!names.length) {
        plots.replaceChildren(el("p", { class: "empty" }, data.metrics_total
          ? "No numeric values of the metrics shown." : "No numeric metrics reported yet."));
      }
      for (const name of names) {
        const series = data.series[name];
        let plot = ckval.plots[name];
        if (plot && plot.root.parentNode.dataset.validators !== drawnValidators(series).join(",")) {
          const box = plot.root.parentNode;  // other validators to draw: a plot of its own
          plot.destroy();
          const fresh = metricPlot(plots, name, series);
          box.replaceWith(fresh.root.parentNode);
          plot = ckval.plots[name] = fresh;
        }
        if (!plot) {
          if (!Object.keys(ckval.plots).length) plots.replaceChildren();
          plot = ckval.plots[name] = metricPlot(plots, name, series);
        } else {
          plot.setData(plotData(series));
        }
        plot.titleNode.textContent = series.best
          ? `best ${fmt(series.best.value)} at report ${series.best.report_index} (${series.mode})`
          : "";
      }
    }

    function drawTimeline(data) {
      const node = document.getElementById("timeline");
      const jobs = data.jobs.filter((job) => job.created_at);
      if (!jobs.length) {
        node.replaceChildren(el("p", { class: "empty" }, "No validation jobs."));
        return;
      }
      const end = (job) => job.finished_at || data.now;
      const t0 = Math.min(...jobs.map((job) => Date.parse(job.created_at)));
      const t1 = Math.max(...jobs.map((job) => Date.parse(end(job))), t0 + 1);
      const pools = [...new Set(jobs.map((job) => job.pool))].sort();
      const label = 150, width = Math.max(480, node.clientWidth - 20), row = 14;
      const x = (iso) => label + ((Date.parse(iso) - t0) / (t1 - t0)) * (width - label - 10);
      const parts = [];
      let y = 4;
      for (const pool of pools) {
        parts.push(svg("text", { x: 0, y: y + 11, "font-weight": 600 }, `pool ${pool}`));
        y += row + 2;
        for (const job of jobs.filter((j) => j.pool === pool)) {
          const started = job.started_at;
          const waitEnd = started || end(job);
          const group = svg("g", { class: "job", "data-job": job.id });
          group.append(svg("title", {}, `job ${job.id} (report ${job.report_index}): ` +
            `${job.status}, queued ${job.created_at}` + (started ? `, started ${started}` : "") +
            (job.finished_at ? `, finished ${job.finished_at}` : "")));
          group.append(svg("text", { x: 8, y: y + 10 }, `#${job.id} report ${job.report_index}`));
          group.append(svg("rect", { x: x(job.created_at), y, height: row - 3, fill: "#d1d5db",
            width: Math.max(1, x(waitEnd) - x(job.created_at)) }));
          if (started) {
            const color = { SUCCEEDED: "#16a34a", FAILED: "#dc2626", TIMED_OUT: "#dc2626",
              CANCELLED: "#9ca3af", WAITING_FOR_RESOURCES: "#f59e0b" }[job.status] || "#2563eb";
            group.append(svg("rect", { x: x(started), y, height: row - 3, fill: color,
              width: Math.max(2, x(end(job)) - x(started)) }));
          }
          parts.push(group);
          y += row;
        }
        y += 6;
      }
      parts.push(svg("text", { x: label, y: y + 10 }, new Date(t0).toISOString()));
      parts.push(svg("text", { x: width - 10, y: y + 10, "text-anchor": "end" },
        `+${took((t1 - t0) / 1000)}`));
      node.replaceChildren(svg("svg", { width, height: y + 16, role: "img" }, ...parts));
    }

    function drawTables(data) {
      const summary = document.getElementById("run-summary");
      summary.replaceChildren(status(data.run.status),
        ` ${data.checkpoints.length} checkpoints · ${data.active_jobs} validations queued or ` +
        `running · ${fmt(data.cost.accelerator_hours)} accelerator-hours · ` +
        `namespace ${data.run.namespace}`);
      drawCost(data.cost);
      replaceRows(document.getElementById("checkpoints"), data.checkpoints.map((c) =>
        el("tr", { "data-report": c.report_index },
          el("td", { class: "num" }, c.report_index),
          el("td", { class: "num" }, fmt(c.step)),
          el("td", {}, status(c.validation_status)),
          el("td", { class: "metrics" }, Object.entries(c.metrics)
            .map(([key, value]) => `${key}=${fmt(value)}`).join("  "),
          Object.entries(c.evaluations || {}).filter(([v]) => v !== "default")
            .map(([v, metrics]) => el("div", { class: "evaluation", "data-validator": v },
              `${v}: ` + Object.entries(metrics)
                .map(([key, value]) => `${key}=${fmt(value)}`).join("  ")))),
          el("td", {}, c.aliases.map((alias) => el("span", { class: "chip" }, alias))),
          el("td", {}, Object.entries(c.tags).map(([key, value]) =>
            el("span", { class: "chip tag" }, `${key}=${value}`))),
          el("td", { class: "num" }, size(c.size_bytes)),
          el("td", { class: "uri" }, c.uri))));
      replaceRows(document.getElementById("jobs"), data.jobs.map((job) => {
        let error = null;
        if (job.error_message || job.error_traceback) {
          const details = el("details", {
            open: openErrors.has(job.id),
            ontoggle: (event) => {
              if (event.target.open) openErrors.add(job.id); else openErrors.delete(job.id);
            },
          }, el("summary", {}, `${job.error_type || "error"}: ${job.error_message || ""}`),
          el("pre", {}, job.error_traceback || "(no traceback)"));
          error = details;
        }
        const wait = job.waiting_for ? el("div", { class: "waiting" }, waitingText(job)) : null;
        return el("tr", { "data-job": job.id },
          el("td", { class: "num" }, job.id),
          el("td", { class: "num" }, job.report_index),
          el("td", {}, job.pool),
          el("td", {}, status(job.status)),
          el("td", { class: "num" }, `${job.attempt_count}/${job.max_attempts}`),
          el("td", { title: job.created_at }, ago(job.created_at)),
          el("td", {}, job.started_at && job.finished_at
            ? took(seconds(job.started_at, job.finished_at)) : "–"),
          el("td", {}, error, wait, (job.warnings || []).map((warning) =>
            el("div", { class: "warning" }, `warning: ${warning}`))));
      }));
    }

    // A job WAITING_FOR_RESOURCES: since when, for what, and why (as `ckval jobs` says).
    function waitingText(job) {
      const asked = Object.entries(job.waiting_for.resources || {}).map(([name, value]) =>
        name.startsWith("accelerator_type:") ? name : `${name}: ${fmt(value)}`).join(", ");
      const since = job.waiting_since ? ` (since ${ago(job.waiting_since)})` : "";
      const note = job.waiting_for.note ? `: ${job.waiting_for.note}` : "";
      return `waiting for {${asked}}${since}${note}`;
    }

    function drawCost(cost) {
      const rows = [["validator", cost.by_validator], ["pool", cost.by_pool],
        ["accelerator type", cost.by_accelerator_type]].flatMap(([by, values]) =>
        Object.entries(values).map(([name, value]) => el("tr", { "data-by": by },
          el("td", {}, by), el("td", {}, name), el("td", { class: "num" }, fmt(value)),
          el("td", { class: "num" }, fmt(value / 3600)))));
      if (!rows.length) {
        rows.push(el("tr", {}, el("td", { colspan: 4, class: "empty" },
          "No validation has run yet.")));
      }
      replaceRows(document.getElementById("cost"), rows);
    }

    // The run's data holds a page of its metrics (the first ones reported, or those
    // chosen here): the note says how many of how many, the picker chooses others.
    function drawMetricChoice(data) {
      const shown = data.metrics_shown.length, total = data.metrics_total;
      const chosen = params.getAll("metric").length > 0;
      let text = `Showing ${shown} of ${total} metrics`;
      if (chosen) text += " (chosen below)";
      else if (shown < total) text += ` (the first ${shown} reported; choose others below)`;
      if (data.metrics_not_found.length) {
        text += `; not in this run: ${data.metrics_not_found.join(", ")}`;
      }
      const note = document.getElementById("metrics-note");
      note.textContent = `${text}.`;
      note.hidden = total === 0;
      document.getElementById("metric-picker").hidden = total < 2;
      const names = [...data.metrics_shown, ...data.metrics_omitted];
      const key = names.join("\u0000");
      if (key === pickerNames) return;  // keep what the reader is selecting
      pickerNames = key;
      const selected = new Set(data.metrics_shown);
      picker.replaceChildren(...names.map((name) =>
        el("option", { value: name, selected: selected.has(name) }, name)));
    }

    function chooseMetrics(names) {
      const problem = document.getElementById("picker-problem");
      const cap = ckval.data.metrics_cap;
      if (names.length > cap) {
        problem.textContent = `Choose at most ${cap} metrics (${names.length} selected).`;
        return;
      }
      problem.textContent = "";
      params.delete("metric");
      params.delete("max_metrics");
      for (const name of names) params.append("metric", name);
      history.replaceState(null, "", params.toString() ? `?${params}` : location.pathname);
      pickerNames = null;
      ckval.refreshNow();
    }
    document.getElementById("show-chosen").addEventListener("click", () =>
      chooseMetrics([...picker.selectedOptions].map((option) => option.value)));
    document.getElementById("show-first").addEventListener("click", () => chooseMetrics([]));

    function drawStopNote(data) {
      const node = document.getElementById("stop-decision");
      const policy = data.stop_policy, decision = data.stop_decision;
      const parts = [];
      if (policy) parts.push(`Stop policy: ${policy.description}.`);
      if (decision) parts.push(`Decision: ${stopText(decision)}.`);
      else if (policy) parts.push("No decision yet.");
      node.hidden = !parts.length;
      node.textContent = parts.join(" ");
    }

    // Named evaluations (revalidate): draw all of them beside report()'s, or the one picked.
    const validatorChoice = document.getElementById("validator-choice");
    ckval.validator = params.get("validator") || "";
    function drawValidatorChoice(data) {
      document.getElementById("validator-picker").hidden = !data.validators.length;
      const options = ["", ...data.validators];
      if (validatorChoice.dataset.options === options.join(",")) return;
      validatorChoice.dataset.options = options.join(",");
      validatorChoice.replaceChildren(...options.map((v) => el("option",
        { value: v, selected: v === ckval.validator }, v ? `default and ${v}` : "all validators")));
    }
    validatorChoice.addEventListener("change", () => {
      ckval.validator = validatorChoice.value;
      if (ckval.validator) params.set("validator", ckval.validator);
      else params.delete("validator");
      history.replaceState(null, "", params.toString() ? `?${params}` : location.pathname);
      drawPlots(ckval.data);
    });

    function draw(data) {
      drawStopNote(data);
      drawMetricChoice(data);
      drawValidatorChoice(data);
      drawPlots(data);
      drawTimeline(data);
      drawTables(data);
    }
    draw(ckval.data);
    keepFresh(() => `${base}/api/runs/${encodeURIComponent(run)}?${params}`, draw);
  }

  // ------------------------------------------------------------- compare page
  function comparePage(container) {
    const data = ckval.data;
    if (!data) return;
    const legend = document.getElementById("compare-legend");
    const box = el("div", { class: "plot" }, el("h3", {}, `${data.metric} (${data.mode} is best)`));
    container.append(box);
    const options = {
      width: plotWidth(container),
      height: 360,
      scales: { x: { time: false } },
      axes: [{ label: "report index", incrs: REPORT_TICKS }, { label: data.metric }],
      series: [{ label: "report" }, ...data.runs.map((run, i) => ({
        label: run, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true,
        points: { show: true, size: 5 },
      }))],
    };
    const columns = (d) => [d.x, ...d.runs.map((run) => d.series[run])];
    const plot = (ckval.plots.compare = new uPlot(options, columns(data), box));
    legend.replaceChildren(...data.runs.map((run, i) => el("li", {},
      el("i", { style: `background:${COLORS[i % COLORS.length]}` }),
      el("a", { href: data.urls[run] }, run))));
    const params = new URLSearchParams(location.search);
    keepFresh(() => `${base}/api/compare?${params}`, (d) => plot.setData(columns(d)));
  }

  // ------------------------------------------------------------------- start
  const runs = document.getElementById("runs");
  const checkpoints = document.getElementById("checkpoints");
  const compare = document.getElementById("compare-plot");
  if (runs) runsPage(runs);
  else if (checkpoints && ckval.data) runPage(ckval.data.run.name);
  else if (compare) comparePage(compare);
})();
