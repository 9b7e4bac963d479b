/* ckval /docs: the HTTP API's routes, read from its OpenAPI document, drawn with DOM
   calls only (no HTML from the document is ever parsed), and nothing from another site. */
(function () {
  "use strict";

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  function schemaName(schema) {
    if (!schema) return "";
    if (schema.$ref) return schema.$ref.split("/").pop();
    if (schema.anyOf) return schema.anyOf.map(schemaName).join(" | ");
    if (schema.type === "array") return schemaName(schema.items) + "[]";
    return schema.type || "";
  }

  function parameters(operation) {
    const rows = (operation.parameters || []).map(function (p) {
      const row = el("tr");
      row.append(
        el("td", "name", p.name + (p.required ? " *" : "")),
        el("td", "", p.in),
        el("td", "", schemaName(p.schema)),
        el("td", "", p.description || (p.schema && p.schema.description) || "")
      );
      return row;
    });
    const body = operation.requestBody && operation.requestBody.content;
    if (body) {
      for (const [type, content] of Object.entries(body)) {
        const row = el("tr");
        row.append(el("td", "name", "body *"), el("td", "", type),
          el("td", "", schemaName(content.schema)), el("td", "", ""));
        rows.push(row);
      }
    }
    if (!rows.length) return el("p", "note", "No parameters.");
    const table = el("table", "grid");
    const head = el("tr");
    ["name", "in", "type", "description"].forEach(function (h) { head.append(el("th", "", h)); });
    table.append(el("thead"), el("tbody"));
    table.tHead.append(head);
    table.tBodies[0].append(...rows);
    return table;
  }

  function draw(spec) {
    const routes = document.getElementById("routes");
    for (const [path, methods] of Object.entries(spec.paths || {})) {
      for (const [method, operation] of Object.entries(methods)) {
        const section = el("section", "route");
        section.dataset.path = path;
        section.dataset.method = method.toUpperCase();
        const title = el("h2");
        title.append(el("code", "method", method.toUpperCase() + " "), el("code", "path", path));
        section.append(title, el("p", "", operation.summary || ""));
        if (operation.description) section.append(el("p", "note", operation.description));
        section.append(parameters(operation));
        routes.append(section);
      }
    }
    document.body.dataset.ready = "true";
  }

  const main = document.getElementById("api-docs");
  fetch(main.dataset.openapi, { credentials: "same-origin" })
    .then(function (answer) {
      if (!answer.ok) throw new Error("GET " + main.dataset.openapi + ": " + answer.status);
      return answer.json();
    })
    .then(draw)
    .catch(function (error) {
      document.getElementById("routes").append(el("p", "note", String(error)));
    });
})();
