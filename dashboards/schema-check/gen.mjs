// Writes a TypeScript file holding the dashboard JSON as an object literal checked with
// `satisfies SlogateDashboard` (see check.ts for why not a JSON import).
// Usage: node gen.mjs [dashboard.json] [out.ts]
//   defaults: ../grafana/slogate.json and build/dashboard.gen.ts (what tsconfig.json checks).
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, relative, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const src = resolve(process.argv[2] ?? resolve(here, '../grafana/slogate.json'));
const out = resolve(process.argv[3] ?? resolve(here, 'build/dashboard.gen.ts'));
const json = JSON.parse(readFileSync(src, 'utf8'));
let check = relative(dirname(out), resolve(here, 'check')).split('\\').join('/');
if (!check.startsWith('.')) check = './' + check;
mkdirSync(dirname(out), { recursive: true });
writeFileSync(out, `// Generated from ${relative(here, src)} by gen.mjs; do not edit.
import type { SlogateDashboard } from '${check}';

export const dashboard = ${JSON.stringify(json, null, 2)} satisfies SlogateDashboard;
`);
