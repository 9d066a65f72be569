// gmem report: draws the data gmem computed (the JSON in #gmem-data) with uPlot. Everything is
// already downsampled in gmem; this script only draws, and filters the tables to a zoomed range.
// When done it sets body[data-rendered] (and data-render-ms); the tests wait for that.
(function () {
  'use strict';
  var violations = 0;
  // A fetch the page's policy blocked: counted where the tests look, and said in the console.
  document.addEventListener('securitypolicyviolation', function (e) {
    violations++;
    document.body.setAttribute('data-csp-violations', String(violations));
    console.error('gmem report: blocked by the page\'s policy: ' + e.blockedURI + ' (' + e.violatedDirective + ')');
  });

  var data = JSON.parse(document.getElementById('gmem-data').textContent);
  var COLORS = ['#4e79a7', '#f28e2b', '#59a14f', '#e15759', '#76b7b2', '#edc948', '#b07aa1', '#ff9da7',
                '#9c755f', '#bab0ac', '#86bcb6', '#d37295'];
  var OTHER_COLORS = ['#bf3989', '#8250df', '#bc4c00', '#4d2d00', '#0a3069', '#1b7c83', '#6639ba'];
  var UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];

  function bytes(n) {
    if (n == null || isNaN(n)) return '–';
    var v = Math.abs(n), u = 0;
    while (v >= 1024 && u < UNITS.length - 1) { v /= 1024; u++; }
    return (n < 0 ? '-' : '') + (u === 0 ? v.toFixed(0) : v.toFixed(2)) + ' ' + UNITS[u];
  }
  var axisName = data.default_axis, axis = data.axes[axisName], inSeconds = axisName === 'time';
  function xText(x) {
    return axisName === 'time' ? x.toFixed(3) + ' s' : axisName === 'step' ? 'step ' + x.toFixed(2) : 'event ' + Math.round(x);
  }
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text != null) e.textContent = text;
    return e;
  }
  function row(table, cells, header) {
    var tr = el('tr');
    cells.forEach(function (c) {
      var cell = el(header ? 'th' : 'td', c.cls ? { 'class': c.cls } : null, c.text);
      if (c.node) cell.appendChild(c.node);
      tr.appendChild(cell);
    });
    table.appendChild(tr);
    return tr;
  }

  if (/^#only-timeline/.test(location.hash)) document.body.classList.add('timeline-only');

  var meta = data.events + ' events; ' + data.steps.count + ' step boundaries (' + data.steps.source + ')';
  if (axis.ooms.length) meta += '; ' + axis.ooms.length + ' out-of-memory event' + (axis.ooms.length > 1 ? 's' : '');
  if (data.headline.history) meta += '. ' + data.headline.history;
  document.getElementById('meta').textContent = meta + '.';

  var width = function () { return Math.max(480, Math.min(document.documentElement.clientWidth - 64, 1392)); };

  // Vertical lines over a chart: steps, OOMs, where each leak began, the peak.
  function marks(u) {
    var ctx = u.ctx, top = u.bbox.top, height = u.bbox.height;
    var min = u.scales.x.min, max = u.scales.x.max;
    function line(x, color, lineWidth, dash) {
      if (x < min || x > max) return;
      var px = Math.round(u.valToPos(x, 'x', true)) + 0.5;
      ctx.save();
      ctx.strokeStyle = color; ctx.lineWidth = lineWidth * devicePixelRatio; ctx.setLineDash(dash);
      ctx.beginPath(); ctx.moveTo(px, top); ctx.lineTo(px, top + height); ctx.stroke();
      ctx.restore();
    }
    // Step lines closer than 6 px would hide the curve: draw them once zoomed in that far.
    var shown = axis.steps.filter(function (x) { return x >= min && x <= max; });
    var apart = true;
    for (var i = 1; i < shown.length && apart; i++)
      apart = u.valToPos(shown[i], 'x') - u.valToPos(shown[i - 1], 'x') >= 6;
    if (apart) shown.forEach(function (x) { line(x, '#8c959f', 1, [3, 3]); });
    line(axis.peak, '#8250df', 2, [2, 2]);
    axis.leaks.forEach(function (x) { line(x, '#fb8500', 2, []); });
    axis.ooms.forEach(function (x) { line(x, '#d1242f', 2, []); });
  }

  var syncing = false, charts = [], range = [-Infinity, Infinity];
  function zoomed(u) {
    if (syncing) return;
    syncing = true;
    var min = u.scales.x.min, max = u.scales.x.max;
    charts.forEach(function (c) { if (c !== u) c.setScale('x', { min: min, max: max }); });
    syncing = false;
    range = [min, max];
    showRange(min, max);
  }
  var valueAxis = { values: function (u, vals) { return vals.map(bytes); }, size: 86 };
  var xAxis = { values: function (u, vals) { return vals.map(function (v) { return inSeconds ? v + ' s' : String(v); }); } };
  var xSeries = { label: 'at', value: function (u, v) { return v == null ? '' : xText(v); } };
  function options(height, series) {
    return { width: width(), height: height, series: series, axes: [xAxis, valueAxis],
             scales: { x: { time: false } }, cursor: { sync: { key: 'gmem' }, drag: { x: true, y: false } },
             hooks: { draw: [marks], setScale: [function (u, key) { if (key === 'x') zoomed(u); }] } };
  }
  // The stacked chart: by site, or by lifetime (where the trace has steps; lifetime_names).
  var stackBy = 'site', names = data.site_names, nsites = names.length, stackVals = null, cum = [];
  var LIFETIME_COLORS = { before: '#8c959f', kept: '#e15759', saved: '#b07aa1', 'this': '#4e79a7' };
  function stackColor(k) {
    return stackBy === 'lifetime' ? LIFETIME_COLORS[names[k].split(' ')[0]] || '#bab0ac' : COLORS[k % COLORS.length];
  }

  // Both charts on the current axis (drawn again when the axis changes).
  function drawCharts() {
    charts.forEach(function (c) { c.destroy(); });
    charts = [];
    var bytesValue = function (u, v) { return bytes(v); };
    var series = [xSeries,
      { label: 'allocated', stroke: '#0969da', width: 1.5, fill: 'rgba(9,105,218,0.12)', value: bytesValue },
      { label: 'reserved, gmem\'s replay', stroke: '#1a7f37', width: 1.5, value: bytesValue }];
    var columns = [axis.x, axis.allocated, axis.reserved];
    if (axis.recorded) {
      series.push({ label: 'reserved, recorded allocator', stroke: '#cf222e', width: 1.5, dash: [6, 3], value: bytesValue });
      columns.push(axis.recorded);
    }
    var others = axisName === 'step' ? (data.others || []).filter(function (o) { return o.axes.step; }) : [];
    if (others.length) {
      // The other runs on the same steps: all sampled on the union of their x, each holding its
      // last value (memory is a step function), nothing past its own end.
      var grid = axis.x;
      others.forEach(function (o) { grid = union(grid, o.axes.step.x); });
      columns = columns.map(function (ys, i) { return i === 0 ? grid : hold(axis.x, ys, grid); });
      others.forEach(function (o, k) {
        var color = OTHER_COLORS[k % OTHER_COLORS.length], name = data.ranks ? 'rank ' + (k + 1) : o.trace;
        series.push({ label: 'allocated, ' + name, stroke: color, width: 1.5, value: bytesValue });
        columns.push(hold(o.axes.step.x, o.axes.step.allocated, grid));
        if (others.length === 1) {
          series.push({ label: 'reserved (gmem), ' + name, stroke: '#8250df', width: 1.5, dash: [2, 3], value: bytesValue });
          columns.push(hold(o.axes.step.x, o.axes.step.reserved, grid));
        }
      });
    }
    charts.push(new uPlot(options(340, series), columns, document.getElementById('timeline')));

    names = stackBy === 'lifetime' ? data.lifetime_names : data.site_names;
    stackVals = stackBy === 'lifetime' ? axis.lifetimes : axis.sites;
    nsites = names.length;
    // Allocated memory by site (or lifetime), stacked: drawn as cumulative sums, the total first, so that each
    // later (lower) band paints over the one above it; the legend shows each site's own bytes.
    cum = [];
    var acc = axis.sites_x.map(function () { return 0; });
    for (var k = 0; k < nsites; k++) {
      acc = acc.map(function (v, c) { return v + stackVals[k][c]; });
      cum.push(acc);
    }
    var stackSeries = [xSeries], stackData = [axis.sites_x];
    for (var j = nsites - 1; j >= 0; j--) {
      (function (site) {
        var vals = stackVals;
        stackSeries.push({ label: names[site], stroke: stackColor(site), width: 1, fill: stackColor(site) + 'cc',
                           value: function (u, v, si, i) { return i == null ? '' : bytes(vals[site][i]); } });
      })(j);
      stackData.push(cum[j]);
    }
    var stackChart = document.getElementById('sites-chart');
    stackChart.textContent = '';
    if (nsites) charts.push(new uPlot(options(300, stackSeries), stackData, stackChart));
    else stackChart.appendChild(el('p', { 'class': 'empty' }, 'No allocations.'));
    range = [-Infinity, Infinity];
    showRange(-Infinity, Infinity);
  }

  function union(a, b) {
    var out = [], i = 0, j = 0;
    while (i < a.length || j < b.length) {
      var v = j >= b.length || (i < a.length && a[i] <= b[j]) ? a[i++] : b[j++];
      if (!out.length || v > out[out.length - 1]) out.push(v);
    }
    return out;
  }
  function hold(xs, ys, grid) {
    var out = new Array(grid.length), j = -1;
    for (var i = 0; i < grid.length; i++) {
      while (j + 1 < xs.length && xs[j + 1] <= grid[i]) j++;
      out[i] = j < 0 || grid[i] > xs[xs.length - 1] ? null : ys[j];
    }
    return out;
  }

  // Two runs: the most each site held in either, largest difference first.
  function showSiteDiff() {
    var table = document.getElementById('site-diff');
    if (!table || !data.compare) return;  // a second run (two traces, not --ranks)
    var a = {}, b = {}, sitesSeen = [];
    data.site_peaks.forEach(function (p) { a[p.site] = p.bytes; sitesSeen.push(p.site); });
    data.compare.site_peaks.forEach(function (p) { b[p.site] = p.bytes; if (!(p.site in a)) sitesSeen.push(p.site); });
    sitesSeen.sort(function (x, y) { return Math.abs((b[y] || 0) - (a[y] || 0)) - Math.abs((b[x] || 0) - (a[x] || 0)); });
    row(table, [{ text: 'site' }, { text: data.trace, cls: 'num' }, { text: data.compare.trace, cls: 'num' },
                { text: 'difference', cls: 'num' }], true);
    sitesSeen.slice(0, 25).forEach(function (site) {
      var d = (b[site] || 0) - (a[site] || 0);
      row(table, [{ text: site, cls: 'site' }, { text: site in a ? bytes(a[site]) : '–', cls: 'num' },
                  { text: site in b ? bytes(b[site]) : '–', cls: 'num' }, { text: (d > 0 ? '+' : '') + bytes(d), cls: 'num' }]);
    });
  }

  function showStack(title, stack, tr) {
    document.querySelectorAll('tr.selected').forEach(function (r) { r.classList.remove('selected'); });
    if (tr) tr.classList.add('selected');
    document.getElementById('stack').textContent = title + '\n' + (stack || '(no stack in the trace)');
  }

  // The tables that follow the zoomed range [min, max].
  function showRange(min, max) {
    var xs = axis.sites_x, first = 0, last = xs.length - 1;
    while (first < last && xs[first] < min) first++;
    while (last > first && xs[last] > max) last--;
    var peakColumn = first, peakTotal = -1;
    for (var c = first; c <= last; c++) {
      var total = nsites ? cum[nsites - 1][c] : 0;
      if (total > peakTotal) { peakTotal = total; peakColumn = c; }
    }
    var whole = min <= xs[0] && max >= xs[xs.length - 1];
    showLargest(whole ? null : { applied: axis.peak_applied[peakColumn], allocated: peakTotal, x: xs[peakColumn] });
    document.getElementById('range').textContent = (whole ? 'The whole trace' : 'From ' + xText(min) + ' to ' + xText(max)) +
      ': allocated peaks at ' + bytes(peakTotal) + ' (' + xText(xs[peakColumn]) + ').';
    var table = document.getElementById('sites');
    table.textContent = '';
    row(table, [{ text: '' }, { text: stackBy === 'lifetime' ? 'lifetime' : 'site' }, { text: 'at the peak of the range', cls: 'num' },
                { text: 'most held in the range', cls: 'num' }], true);
    for (var k = 0; k < nsites; k++) {
      var most = 0;
      for (var c2 = first; c2 <= last; c2++) most = Math.max(most, stackVals[k][c2]);
      var swatch = el('span', { 'class': 'swatch' });
      swatch.style.background = stackColor(k);
      row(table, [{ node: swatch }, { text: names[k], cls: 'site' },
                  { text: bytes(stackVals[k][peakColumn]), cls: 'num' }, { text: bytes(most), cls: 'num' }]);
    }
    var leaks = document.getElementById('leaks');
    leaks.textContent = '';
    var shown = data.leaks.filter(function (l, i) { return axis.leaks[i] <= max; });
    if (!shown.length) {
      leaks.appendChild(el('caption', { 'class': 'empty' },
        data.leaks.length ? 'No leak had begun by the end of the range.' : 'No leaks found (' + data.steps.source + ').'));
      return;
    }
    row(leaks, [{ text: 'site' }, { text: 'per step', cls: 'num' }, { text: 'kept', cls: 'num' },
                { text: 'grew in', cls: 'num' }, { text: 'graphs kept', cls: 'num' }, { text: 'began', cls: 'num' }], true);
    data.leaks.forEach(function (l, i) {
      if (axis.leaks[i] > max) return;
      var tr = row(leaks, [{ text: l.site, cls: 'site' }, { text: '+' + bytes(l.bytes_per_step), cls: 'num' },
        { text: bytes(l.surviving_bytes), cls: 'num' }, { text: l.growing_periods + ' of ' + l.periods + ' steps', cls: 'num' },
        { text: l.graph_bytes ? bytes(l.graph_bytes) : '–', cls: 'num' }, { text: xText(axis.leaks[i]), cls: 'num' }]);
      tr.classList.add('clickable');
      tr.addEventListener('click', function () { showStack('leak at ' + l.site + ', a block still live:', l.stack, tr); });
    });
  }

  // The largest blocks live at the peak: the trace's (exact), or a zoomed range's (`at`: the
  // column's highest point as events applied), from the trace's largest blocks gmem kept.
  function showLargest(at) {
    var largest = document.getElementById('largest');
    largest.textContent = '';
    document.getElementById('largest-title').textContent = at ? 'Largest live blocks at the range\'s peak' : 'Largest live blocks at the peak';
    var blocks = data.largest.blocks, caption;
    if (at) {
      blocks = [];
      data.blocks.list.forEach(function (k) {
        // [size, alloc event, free event, address, time, before the history, site, stack]
        if (k[1] < at.applied && k[2] >= at.applied && blocks.length < 25)  // the list is largest first
          blocks.push({ size: k[0], event: k[1], addr: k[3], time: k[4], before_history: k[5], site: k[6],
                        stack: data.blocks.stacks[k[7]] });
      });
      caption = bytes(at.allocated) + ' allocated at the range\'s peak (' + xText(at.x) + '); the ' + blocks.length +
        ' largest blocks then live' + (data.blocks.smaller_left_out ? ' of at least ' + bytes(data.blocks.smaller_left_out) +
        ' (the page keeps the trace\'s ' + data.blocks.list.length + ' largest)' : '') + ':';
    } else {
      caption = bytes(data.largest.allocated) + ' allocated at the peak (' + xText(axis.peak) + '); the ' +
        blocks.length + ' largest blocks then live:';
    }
    if (!blocks.length) {
      largest.appendChild(el('caption', { 'class': 'empty' }, at ? 'No block of the largest kept was live at the range\'s peak.' : 'No live blocks.'));
      return;
    }
    largest.appendChild(el('caption', null, caption));
    row(largest, [{ text: 'size', cls: 'num' }, { text: 'site' }, { text: 'allocated at', cls: 'num' }, { text: 'address' }], true);
    blocks.forEach(function (b) {
      var tr = row(largest, [{ text: bytes(b.size), cls: 'num' }, { text: b.site, cls: 'site' },
        { text: b.before_history ? 'before the history' : xText(inSeconds ? b.time : b.event), cls: 'num' },
        { text: '0x' + b.addr.toString(16), cls: 'site' }]);
      tr.classList.add('clickable');
      tr.addEventListener('click', function () { showStack(bytes(b.size) + ' at 0x' + b.addr.toString(16) + ':', b.stack, tr); });
    });
  }

  // The x axis: time, or events (an idle start can squeeze the steps into a sliver of time).
  var toggle = document.getElementById('axis');
  Object.keys(data.axes).forEach(function (name) {
    var button = el('button', { type: 'button', 'data-axis': name },
                    name === 'time' ? 'x: time' : name === 'step' ? 'x: steps' : 'x: events');
    button.addEventListener('click', function () { setAxis(name); });
    toggle.appendChild(button);
  });
  function setAxis(name) {
    axisName = name; axis = data.axes[name]; inSeconds = name === 'time';
    xAxis.values = function (u, vals) { return vals.map(function (v) { return inSeconds ? v + ' s' : String(v); }); };
    toggle.querySelectorAll('button').forEach(function (b) { b.classList.toggle('on', b.getAttribute('data-axis') === name); });
    drawCharts();
  }
  // By site or by lifetime: lifetimes come from step boundaries, so only where the trace has them.
  var stackToggle = document.getElementById('stack-by');
  if (data.lifetime_names && stackToggle) {
    [['site', 'by site'], ['lifetime', 'by lifetime']].forEach(function (choice) {
      var button = el('button', { type: 'button', 'data-stack': choice[0] }, choice[1]);
      button.addEventListener('click', function () { setStack(choice[0]); });
      stackToggle.appendChild(button);
    });
  }
  function setStack(by, noDraw) {
    stackBy = by;
    if (stackToggle) stackToggle.querySelectorAll('button').forEach(function (b) { b.classList.toggle('on', b.getAttribute('data-stack') === by); });
    document.getElementById('stack-title').textContent = by === 'lifetime' ? 'Allocated memory by lifetime' : 'Allocated memory by site';
    document.getElementById('stack-note').textContent = by === 'lifetime'
      ? 'By lifetime, from the step boundaries (' + data.steps.source + '): allocated before the first step, kept ' +
        'across a step boundary, or this step\'s own (freed in the step that allocated it). A trace does not say ' +
        'which blocks are parameters, gradients or optimizer state: the examples in brackets are what such blocks usually are.'
      : '';
    if (!noDraw) drawCharts();
  }
  if (/[#&]stack=lifetime/.test(location.hash) && data.lifetime_names) setStack('lifetime', true);
  else setStack('site', true);
  data.compare = !data.ranks && data.others && data.others.length === 1 ? data.others[0] : null;
  if (data.others && data.axes.step) axisName = 'step';
  if (/[#&]x=event/.test(location.hash) && data.axes.event) axisName = 'event';
  showSiteDiff();
  setAxis(axisName);
  document.getElementById('summary').textContent = data.summary;
  // #zoom=MIN,MAX: opens zoomed into that range of the x axis (a link to a range; the tests use it).
  var zoom = /[#&]zoom=([-0-9.e]+),([-0-9.e]+)/.exec(location.hash);
  if (zoom && charts.length) charts[0].setScale('x', { min: parseFloat(zoom[1]), max: parseFloat(zoom[2]) });

  window.addEventListener('resize', function () { charts.forEach(function (c) { c.setSize({ width: width(), height: c.height }); }); });
  document.body.setAttribute('data-rendered', '1');
  document.body.setAttribute('data-render-ms', String(Math.round(performance.now())));
})();
