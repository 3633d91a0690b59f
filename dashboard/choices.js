// The sidebar's choices as groups of toggle buttons: each option a <button aria-pressed>, every label set as
// text (never as HTML or markdown). A click sends state "picked" = {values: {key: [chosen options]} for every
// group drawn here, nonce} (dashboard/choices.py keeps the choices): two quick clicks in different groups
// are both in the last message. A single choice keeps one option pressed. Payload: dashboard/choices.py
// (bytes). el, helpIcon, drawOnce: component_base.js.

function pressed(group, chosen) {
  for (const b of group.querySelectorAll("button.ch-pill")) b.setAttribute("aria-pressed", String(chosen.has(b.dataset.value)));
}

export default function (component) {
  const { setStateValue } = component;
  drawOnce(component, "ch-box", (box, data) => {
    const chosenOf = {}; // each group's chosen options, as drawn now
    const send = () => setStateValue("picked", {
      values: Object.fromEntries(Object.entries(chosenOf).map(([k, c]) => [k, [...c]])),
      nonce: `${Date.now()}-${Math.random()}`,
    });
    box.replaceChildren(...data.groups.map((g) => {
      const group = el("div", "ch-group");
      group.dataset.key = g.key;
      group.setAttribute("role", "group");
      group.setAttribute("aria-label", g.label);
      if (g.heading) group.appendChild(el("h3", "ch-heading", g.heading));
      const label = el("div", "ch-label");
      label.appendChild(el("span", null, g.label));
      if (g.help) label.appendChild(helpIcon(g.help));
      if (!g.hide_label) group.appendChild(label);
      const row = el("div", "ch-row");
      const chosen = new Set(g.selected);
      chosenOf[g.key] = chosen;
      g.options.forEach((value, i) => {
        const b = el("button", "ch-pill", g.shown[i]);
        b.type = "button";
        b.dataset.value = value;
        b.addEventListener("click", () => {
          let next;
          if (g.multi) {
            next = g.options.filter((o) => (o === value ? !chosen.has(o) : chosen.has(o)));
          } else if (chosen.has(value)) {
            return; // a single choice keeps one option
          } else {
            next = [value];
          }
          chosen.clear();
          next.forEach((o) => chosen.add(o));
          pressed(group, chosen);
          send();
        });
        row.appendChild(b);
      });
      group.appendChild(row);
      pressed(group, chosen);
      return group;
    }));
  });
}
