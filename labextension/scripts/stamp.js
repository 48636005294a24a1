// Record which sources the committed build was made from (tests/test_labextension.py checks it).
const crypto = require('crypto');
const fs = require('fs');
const path = require('path');

const here = path.resolve(__dirname, '..');
const files = ['package.json', 'tsconfig.json', 'install.json']
  .concat(fs.readdirSync(path.join(here, 'src')).map(f => `src/${f}`))
  .concat(fs.readdirSync(path.join(here, 'style')).map(f => `style/${f}`))
  .sort();
const hash = crypto.createHash('sha256');
for (const f of files) {
  hash.update(f + '\0');
  hash.update(fs.readFileSync(path.join(here, f)));
  hash.update('\0');
}
const out = path.join(here, '..', 'smolbench', 'labextension', 'build-sources.sha256');
fs.writeFileSync(out, hash.digest('hex') + '\n');
console.log(`smolbench labextension built: ${out}`);
